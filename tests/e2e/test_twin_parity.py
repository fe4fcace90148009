"""`Client` and `AsyncClient` are twins (docs/client.md, "Clients"): the same options, errors
and semantics, except what blocking or awaiting forces.  Each scenario here runs on both,
against one broker and its workers (started once for the module), through one script: a
blocking client is seen through the asyncio twin's interface (`Blocking`: its waiting methods
as coroutines that block), so that the two outcomes come from the same steps.  What each step
returned or raised (class and code) must be the same on both: options and arguments (bad
types, NaN, inf, negatives), a closed client, handles, calls' deadlines and errors, streams,
pinning, no broker, a stopped one, a restarted one, a socket that takes nothing.
(`TWIN_SHOW=1 pytest -s` prints every step's outcome and what each twin raised.)

Differences this found, each failed here before its fix: a request the socket did not take
by its deadline (`Client`: BrokerUnreachable, `AsyncClient`: DeadlineExceeded); `submit` on
a closed client (a raw ZMQError, and True with the call registered for good) and `with` on
one (entered); a stream's `recv()` after its client closed (`Stream` raised at once where
`AsyncStream`, and both twins' handles, hand out what had arrived).

This module is also its worker's model (`--model test_twin_parity:twin`, tests/e2e on the
worker's PYTHONPATH): it imports nothing from the test package at import time.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import os
import signal
import time

import numpy as np
import pytest

from client_sdk import AsyncClient, Client, Priority
from client_sdk.tensors import Result

pytestmark = pytest.mark.timeout(60)

HB = 0.2       # the processes' heartbeat interval
WAIT = 10.0    # bound of every wait that should end by itself
SLOW = 0.3     # seconds the `twin` model takes for a slow request
SHORT = 0.1    # a deadline (or a wait) shorter than SLOW


def twin(device: str = "cpu"):
    """Echoes `x`; with x[0] > 0 it first sleeps x[0] seconds, with x[0] == -1 it raises."""
    def run(inputs):
        x = np.asarray(inputs["x"])
        v = float(x.flat[0]) if x.size else 0.0
        if v == -1:
            raise ValueError("asked to fail")
        if v > 0:
            time.sleep(v)  # the model's own work, not a synchronisation
        return {"x": np.array(x, copy=True)}

    run.name = "twin"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.zeros(1)}
    return run


# ----------------------------------------------------------------------------- the twins as one

#: what waits on `AsyncClient` (a coroutine there), on the client, its handles and streams
_WAITS = {"Client": frozenset({"infer", "request", "mmi_service", "pump", "close"}),
          "ReplyStream": frozenset({"result"}), "Stream": frozenset({"recv"})}


class Blocking:
    """A `Client` (or its `ReplyStream`, `Stream`) seen as its asyncio twin: the methods that
    are coroutines there are coroutines here that make the blocking call when awaited;
    `infer_stream` and `stream` hand back their objects seen the same way."""

    def __init__(self, obj):
        self._o = obj

    def __getattr__(self, name):
        v = getattr(self._o, name)
        if name in _WAITS[type(self._o).__name__]:
            async def waits(*a, **k):
                return v(*a, **k)
            return waits
        if name in ("infer_stream", "stream"):
            return lambda *a, **k: Blocking(v(*a, **k))
        return v

    async def __aenter__(self):
        self._o.__enter__()
        return self

    async def __aexit__(self, *exc):
        self._o.__exit__(*exc)

    def __aiter__(self):
        it = iter(self._o)

        async def each():
            for r in it:
                yield r

        return each()


def said(e: BaseException) -> tuple:
    return (type(e).__name__, getattr(e, "code", None))


def seen(v) -> object:
    """What a step returned, comparable across the twins."""
    if isinstance(v, Result):
        out = ("Result", v.final, v.frame, tuple((k, np.asarray(a).tolist()) for k, a in sorted(v.items())))
        v.release()
        return out
    if isinstance(v, Blocking):
        v = v._o
    if isinstance(v, (bool, int, float, str, type(None))):
        return v
    if isinstance(v, list) and all(isinstance(f, (bytes, bytearray)) for f in v):
        return [bytes(f) for f in v]
    return type(v).__name__.replace("Async", "")


MESSAGES: dict[str, list[str]] = {}


async def step(fn) -> object:
    """``fn()`` (awaited when it returns an awaitable): what it returned (`seen`) or raised."""
    try:
        v = fn()
        if inspect.isawaitable(v):
            v = await v
    except (KeyboardInterrupt, asyncio.CancelledError):
        raise
    except BaseException as e:
        MESSAGES.setdefault(_twin_now, []).append(f"{type(e).__name__}: {e}")
        return said(e)
    return seen(v)


_twin_now = ""


def on_both(endpoint: str, scenario, **opts) -> list:
    """Run ``scenario(client)`` on a `Client` and an `AsyncClient` made with ``opts``; the
    steps' outcomes (a list) must be the same.  Returns them."""
    global _twin_now
    got = {}
    for name in ("sync", "async"):
        _twin_now = name
        MESSAGES[name] = []

        async def main():
            c = Blocking(Client(endpoint, **opts)) if name == "sync" else AsyncClient(endpoint, **opts)
            try:
                return await scenario(c)
            finally:
                await c.close(linger=0)

        got[name] = asyncio.run(main())
    if os.environ.get("TWIN_SHOW"):
        for i, o in enumerate(got["sync"]):
            print(i, o)
        for name in ("sync", "async"):
            print(name, "raised:", *MESSAGES[name], sep="\n  ")
    assert got["sync"] == got["async"], _differences(got)
    return got["sync"]


def _differences(got: dict) -> str:
    lines = ["the twins differ (step: sync | async):"]
    for i, (a, b) in enumerate(zip(got["sync"], got["async"])):
        if a != b:
            lines.append(f"{i}: {a!r} | {b!r}")
    for name in ("sync", "async"):
        lines.append(f"{name} raised: " + " / ".join(m[:200] for m in MESSAGES.get(name, [])))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the processes

@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    """A broker (short service grace), an echo worker that takes leases, a `twin` worker and a
    streaming (`chunks`) worker; and a second broker with no worker, for stops."""
    from .conftest import Cluster, Proc

    c = Cluster(tmp_path_factory.mktemp("twins"))
    spare = None
    try:
        c.broker("--service-grace", "0.3")
        ws = [c.worker("echo", "--direct", wait=False), c.worker("test_twin_parity:twin", wait=False),
              c.worker("chunks", wait=False)]
        spare_fe = f"ipc://{c.tmp}/spare.ipc"
        spare = Proc(["-m", "broker", "--frontend", spare_fe, "--backend", f"ipc://{c.tmp}/spare-be.ipc",
                      "--heartbeat-interval", str(HB)])
        for w in ws:
            w.wait_ready()
        spare.wait_ready()
        c.spare = spare
        c.spare_frontend = spare_fe
        with Client(c.frontend, timeout=WAIT) as probe:
            for service in ("echo", "twin", "chunks"):
                deadline = time.monotonic() + 20
                while not probe.mmi_service(service):
                    assert time.monotonic() < deadline, f"no worker for {service}"
                    time.sleep(0.01)  # polling a condition
        yield c
    finally:
        try:
            if spare is not None:
                if spare.p.poll() is None:
                    os.kill(spare.p.pid, signal.SIGCONT)  # (a test stopped it)
                spare.close()
        finally:
            c.close()


X = {"x": np.arange(4, dtype=np.float32)}
BIG = {"x": np.arange(2048, dtype=np.float32)}  # over 4 KiB: through shared memory


def slow(v: float = SLOW) -> dict:
    return {"x": np.full(4, v, np.float32)}


FAIL = {"x": np.full(4, -1.0, np.float32)}


# ----------------------------------------------------------------------------- options

@pytest.mark.parametrize("opt,values", [
    ("timeout", [0, -1, -math.inf, math.nan, "1", True, [], None, math.inf, 1e300, 0.5]),
    ("heartbeat_interval", [-1, math.nan, math.inf, "1", 0.0001, True, 0, None, 0.5]),
    ("linger", [-1, math.nan, math.inf, "1", None, True, 0, 2]),
    ("pin", [0, -1, 65537, 1.5, "1", None, math.nan, True, 1, 65536, False]),
    ("max_inline_mb", [0, -1, math.nan, math.inf, "1", True, None, 0.5]),
    ("pool_capacity", [0, -1, math.nan, "1", True, None, 1.5, 1 << 20]),
    ("restart_resends", [-1, math.nan, "1", True, None, 1.5, 0]),
    ("transport", ["bogus", None, 1, "inline", "shm", "auto"]),
    ("direct_reply", ["yes", None, 1, False]),
    ("fallback_inline", ["yes", None, 1, False]),
    ("insecure", ["yes", 1, True]),
    ("server_key", [1, "nope"]),
])
def test_both_twins_take_and_refuse_the_same_options(cl, opt, values):
    for v in values:
        out = {}
        for name, make in (("sync", Client), ("async", AsyncClient)):
            try:
                c = make(cl.frontend, **{opt: v})
            except Exception as e:
                out[name] = said(e)
            else:
                out[name] = "ok"
                if name == "sync":
                    c.close()
                else:
                    asyncio.run(c.close())
        assert out["sync"] == out["async"], (opt, v, out)


def test_both_twins_refuse_the_same_endpoints(tmp_path):
    for ep in [1, None, "nope", "ipc:/", f"ipc://{tmp_path}/x.ipc"]:
        out = {}
        for name, make in (("sync", Client), ("async", AsyncClient)):
            try:
                c = make(ep)
            except Exception as e:
                out[name] = said(e)
            else:
                out[name] = "ok"
                if name == "sync":
                    c.close()
                else:
                    asyncio.run(c.close())
        assert out["sync"] == out["async"], (ep, out)


# ----------------------------------------------------------------------------- arguments

CALL_ARGS = [
    # (what, how): each made on an open client; the twins must agree
    *[("infer timeout", v) for v in (0, -1, math.nan, "1", True, [], math.inf, 1e300)],
    *[("infer priority", v) for v in ("bogus", 3, -1, 1.5, True, None, "URGENT", Priority.BACKGROUND, np.int64(0))],
    *[("infer meta", v) for v in (1, "x", {"a": object()}, {1: 2}, {"a": 1 << 70}, {}, {"a": [1, "b"]})],
    *[("infer reply", v) for v in ("bogus", 1, None, "inline", "shm")],
    *[("infer traceparent", v) for v in (1, b"00", "garbage")],
    *[("infer service", v) for v in (1, "", "x" * 300, "\udc80", b"echo")],
    *[("infer inputs", v) for v in (None, [], 1, {"x": object()}, {1: X["x"]}, {"x": None}, {"": X["x"]})],
    *[("infer_stream timeout", v) for v in (0, math.nan, "1")],
    *[("prepare priority", v) for v in ("bogus", 1.5)],
    *[("stream max_in_flight", v) for v in (0, -1, 1.5, math.nan, math.inf, "2", True, None, 3)],
    *[("stream timeout", v) for v in (0, math.nan, "1")],
    *[("stream meta", v) for v in (1, {"a": object()})],
    *[("stream reply", v) for v in ("bogus",)],
    *[("stream pin", v) for v in ("x", 1, 0)],
    *[("stream service", v) for v in (1, "")],
    *[("request frames", v) for v in (b"x", [], [1], ["x"], [b"x", 1])],
    *[("request service", v) for v in (1, "")],
    *[("request timeout", v) for v in (0, -1, math.nan, "1")],
    *[("mmi_service name", v) for v in (1, None, b"echo", "\udc80", "", "x" * 300)],
    *[("mmi_service timeout", v) for v in (0, -1, math.nan, "1")],
    *[("pump timeout", v) for v in (math.nan, "1", -1, 0, [])],
    *[("close linger", v) for v in (-1, math.nan, math.inf, "1", [])],
    *[("alloc shape", v) for v in (-1, "x", (2, -1), True, (1.5,))],
    *[("alloc dtype", v) for v in (object, "nope", None)],
    *[("free", v) for v in (np.zeros(3), "x", None)],
    *[("pinned", v) for v in (1, None, "nope")],
    *[("result timeout", v) for v in (math.nan, "1", [])],
    *[("recv timeout", v) for v in (math.nan, "1", [])],
]


async def _with_arg(c, what: str, v) -> list:
    method, _, arg = what.partition(" ")
    out = []
    if method in ("infer", "infer_stream", "prepare"):
        kw = {"service": "echo", "inputs": X}
        kw[arg] = v
        service, inputs = kw.pop("service"), kw.pop("inputs")
        r = await step(lambda: getattr(c, method)(service, inputs, **kw))
        if method != "infer" and r in ("ReplyStream", "Call"):
            r = "made"  # (the handle or call itself: not comparable; closed with the client)
        out.append(r)
    elif method == "stream":
        kw = {arg: v} if arg != "service" else {}
        service = v if arg == "service" else "echo"
        r = await step(lambda: c.stream(service, **kw))
        out.append("made" if r == "Stream" else r)
    elif method == "request":
        kw = {"service": "echo", "frames": [b"hi"], "timeout": WAIT}
        kw[arg] = v
        out.append(await step(lambda: c.request(kw["service"], kw["frames"], timeout=kw["timeout"])))
    elif method == "mmi_service":
        kw = {"name": "echo", "timeout": WAIT}
        kw[arg] = v
        out.append(await step(lambda: c.mmi_service(kw["name"], timeout=kw["timeout"])))
    elif method == "pump":
        out.append(await step(lambda: c.pump(v)))
    elif method == "close":
        out.append(await step(lambda: c.close(linger=v)))
        out.append(c.closed)
    elif method == "alloc":
        kw = {"shape": (2,), "dtype": np.float32}
        kw[arg] = v
        out.append(await step(lambda: c.alloc(kw["shape"], kw["dtype"])))
    elif method == "free":
        out.append(await step(lambda: c.free(v)))
    elif method == "pinned":
        out.append(await step(lambda: c.pinned(v)))
    elif method == "result":
        h = c.infer_stream("echo", X)
        out.append(await step(lambda: h.result(timeout=v)))
        out.append(await step(lambda: h.result(timeout=WAIT)))  # the handle is as it was
    elif method == "recv":
        s = c.stream("echo", pin=False)
        s.send(X)
        out.append(await step(lambda: s.recv(timeout=v)))
        out.append(await step(lambda: s.recv(timeout=WAIT)))  # the frame stayed in flight
        s.close()
    out.append(await step(lambda: c.infer("echo", X)))  # the client serves on
    return out


def test_both_twins_take_and_refuse_the_same_arguments(cl):
    async def scenario(c):
        out = []
        for what, v in CALL_ARGS:
            out.append((what, repr(v), await _with_arg(c, what, v)))
        return out

    on_both(cl.frontend, scenario, timeout=WAIT)


# ----------------------------------------------------------------------------- a closed client

def test_both_twins_refuse_the_same_calls_once_closed(cl):
    async def scenario(c):
        alloc = c.alloc((4,), np.float32)
        made = c.prepare("echo", X)
        await c.close()
        out = [c.closed]
        out.append(await step(lambda: c.infer("echo", X)))
        out.append(await step(lambda: c.infer_stream("echo", X)))
        out.append(await step(lambda: c.stream("echo")))
        out.append(await step(lambda: c.request("echo", [b"hi"])))
        out.append(await step(lambda: c.mmi_service("echo")))
        out.append(await step(lambda: c.prepare("echo", X)))
        out.append(await step(lambda: c.submit(made)))
        out.append(await step(lambda: c.give_up(made)))
        out.append(await step(lambda: c.pump(0)))
        out.append(await step(lambda: c.alloc((2,))))
        out.append(await step(lambda: c.free(alloc)))
        out.append(await step(lambda: c.pinned("echo")))
        out.append(await step(lambda: c.in_flight()))
        out.append(await step(lambda: c.close()))
        out.append(await step(lambda: c.close(linger=-1)))

        async def again():
            async with c:
                return "entered"
        out.append(await step(again))
        return out

    got = on_both(cl.frontend, scenario, timeout=WAIT)
    # Every call refused before anything is sent (`submit` had raised a raw ZMQError on the
    # blocking twin, and returned True on the asyncio one, its call registered for good),
    # `with` included (the blocking twin entered); give_up, pinned, in_flight and close do
    # nothing.
    refused = [i for i, o in enumerate(got) if isinstance(o, tuple) and o[0] == "InferenceError"]
    assert refused == [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 16], got
    assert got[8] is None and got[12] is False and got[13] == 0, got


# ----------------------------------------------------------------------------- handles

def test_both_twins_handles_behave_alike(cl):
    async def scenario(c):
        out = []
        # waiting less than the request takes: TimeoutError, the request stays in flight
        h = c.infer_stream("twin", slow())
        out.append(await step(lambda: h.result(timeout=SHORT)))
        out.append(await step(h.cancel))
        out.append(await step(h.cancel))
        out.append(h.cancelled)
        out.append(await step(lambda: h.result()))
        out.append(await step(lambda: h.result(timeout=0)))
        # its FINAL taken: EndOfStream, nothing to cancel
        h = c.infer_stream("echo", X)
        out.append(await step(lambda: h.result(timeout=WAIT)))
        out.append(await step(lambda: h.result(timeout=WAIT)))
        out.append(await step(h.cancel))
        out.append(h.cancelled)
        # closed: the iteration ends, result() says EndOfStream
        h = c.infer_stream("twin", slow())
        h.close()
        out.append(await step(h.cancel))
        out.append(await step(lambda: h.result(timeout=WAIT)))
        out.append([seen(r) async for r in h])
        # the request's own deadline
        h = c.infer_stream("twin", slow(), timeout=SHORT)
        out.append(await step(lambda: h.result()))
        out.append(await step(lambda: h.result()))
        out.append(await step(h.cancel))
        # iterated: each PARTIAL, then the FINAL
        h = c.infer_stream("chunks", {"x": np.arange(8, dtype=np.float32).reshape(1, 8)})
        out.append([seen(r) async for r in h])
        out.append(await step(lambda: h.result()))
        out.append(await step(lambda: c.infer_stream("chunks", {"x": np.ones((1, 8), np.float32)}).result()))
        # a failing model, an unknown service
        out.append(await step(lambda: c.infer_stream("twin", FAIL).result()))
        out.append(await step(lambda: c.infer_stream("nobody-serves-this", X).result()))
        return out

    on_both(cl.frontend, scenario, timeout=WAIT)


def test_both_twins_handles_after_their_client_closed(cl):
    async def scenario(c):
        out = []
        arrived = c.infer_stream("echo", X)
        waiting = c.infer_stream("twin", slow())
        taken = c.infer_stream("echo", X)
        out.append(await step(lambda: taken.result(timeout=WAIT)))
        deadline = time.monotonic() + WAIT
        while c.in_flight() > 1:  # `arrived`'s FINAL routed (a blocking client routes in its calls)
            assert time.monotonic() < deadline
            await c.pump(0.01)
        await c.close()
        for h in (arrived, waiting, taken):
            out.append(await step(lambda: h.result(timeout=WAIT)))
            out.append(await step(h.cancel))
            out.append(await step(lambda: h.result(timeout=WAIT)))
        return out

    on_both(cl.frontend, scenario, timeout=WAIT)


# ----------------------------------------------------------------------------- calls

def test_both_twins_calls_end_alike(cl):
    async def scenario(c):
        out = []
        out.append(await step(lambda: c.infer("twin", slow(), timeout=SHORT)))
        out.append(await step(lambda: c.infer("twin", slow())))  # the client's default (SHORT)
        out.append(await step(lambda: c.infer("twin", slow(), timeout=math.inf)))
        out.append(await step(lambda: c.infer("twin", slow(0.05), timeout=1e300)))
        out.append(await step(lambda: c.infer("twin", FAIL, timeout=WAIT)))
        out.append(await step(lambda: c.infer("nobody-serves-this", X, timeout=WAIT)))
        out.append(await step(lambda: c.infer("chunks", {"x": np.ones((1, 8), np.float32)}, timeout=WAIT)))
        for p in ("urgent", Priority.BACKGROUND, 0, np.int8(2)):
            out.append(await step(lambda: c.infer("echo", X, priority=p, timeout=WAIT)))
        for r in ("inline", "shm", "auto"):
            out.append(await step(lambda: c.infer("echo", BIG, reply=r, timeout=WAIT)))
        out.append(await step(lambda: c.infer("echo", X, meta={"a": 1}, timeout=WAIT)))
        out.append(await step(lambda: c.mmi_service("echo", timeout=WAIT)))
        out.append(await step(lambda: c.mmi_service("nobody-serves-this", timeout=WAIT)))
        out.append(await step(lambda: c.request("echo", [b"hi"], timeout=WAIT)))
        out.append(await step(lambda: c.request("nobody-serves-this", [b"hi"], timeout=WAIT)))
        out.append(await step(lambda: c.request("twin", [b"hi"], timeout=SHORT)))
        return out

    on_both(cl.frontend, scenario, timeout=SHORT)


# ----------------------------------------------------------------------------- streams

def test_both_twins_streams_behave_alike(cl):
    async def scenario(c):
        out = []
        async with c.stream("echo", latest_wins=False, max_in_flight=2, pin=False) as s:
            out.append([s.send({"x": np.full(4, i, np.float32)}) for i in range(5)])
            out.append([await step(lambda: s.recv(timeout=WAIT)) for _ in range(5)])
            # (nothing outstanding: `Stream.recv` raises EndOfStream, `AsyncStream.recv` waits for
            # the next send(), another task's: docs/client.md, "Streams")
            st = s.stats()
            out.append((st.sent, st.completed, st.failed, st.dropped, st.in_flight, st.pending, st.cancelled))
        out.append(await step(lambda: s.send(X)))
        out.append(await step(lambda: s.recv(timeout=0)))
        # latest wins: a slow model gets the newest frame next
        async with c.stream("twin", max_in_flight=1, pin=False, timeout=WAIT) as s:
            # (the first frame runs for 0.5 s: the recv(timeout=0) below must find it in flight
            # even on a loaded machine)
            out.append([s.send(slow(0.5 + i / 100)) for i in range(5)])
            out.append(s.dropped)
            out.append(await step(lambda: s.recv(timeout=0)))  # the frame stays in flight
            out.append([await step(lambda: s.recv(timeout=WAIT)) for _ in range(2)])
            st = s.stats()
            out.append((st.sent, st.completed, st.failed, st.dropped, st.in_flight, st.pending, st.cancelled))
        # a frame past its deadline, a failing one among good ones, closed with frames in flight
        async with c.stream("twin", latest_wins=False, max_in_flight=3, pin=False, timeout=SHORT) as s:
            s.send(slow())
            s.send(FAIL)
            s.send(X)
            out.append([await step(lambda: s.recv(timeout=WAIT)) for _ in range(3)])
            s.send(slow())
            s.send(slow())
        st = s.stats()
        out.append((st.sent, st.completed, st.failed, st.dropped, st.in_flight, st.pending, st.cancelled))
        # a streaming service: each frame NotSupported
        async with c.stream("chunks", pin=False, timeout=WAIT) as s:
            s.send({"x": np.ones((1, 8), np.float32)})
            out.append(await step(lambda: s.recv(timeout=WAIT)))
        return out

    on_both(cl.frontend, scenario, timeout=WAIT)


def test_both_twins_streams_after_their_client_closed(cl):
    async def scenario(c):
        out = []
        s = c.stream("echo", latest_wins=False, pin=False)
        s.send(X)
        deadline = time.monotonic() + WAIT
        while c.in_flight():  # its result routed
            assert time.monotonic() < deadline
            await c.pump(0.01)
        s.send(slow())  # (echo answers it at once: in flight or arrived)
        await c.close()
        out.append(await step(lambda: s.recv(timeout=WAIT)))
        out.append(await step(lambda: s.recv(timeout=WAIT)))
        out.append(await step(lambda: s.send(X)))
        s.close()
        out.append(await step(lambda: s.recv(timeout=WAIT)))
        return out

    got = on_both(cl.frontend, scenario, timeout=WAIT)
    # what had arrived, then "the client was closed" (the blocking twin raised at once), and
    # the stream's own close says EndOfStream
    assert [o[0] for o in got] == ["Result", "InferenceError", "InferenceError", "EndOfStream"], got


# ----------------------------------------------------------------------------- pinned

def test_both_twins_pin_a_stream_alike(cl):
    async def scenario(c):
        out = [c.pinned("echo"), c.pinned_replies]
        async with c.stream("echo", latest_wins=False) as s:
            deadline = time.monotonic() + WAIT
            sent = 0
            while not c.pinned("echo"):  # the lease granted (the blocking client reads in its calls)
                assert time.monotonic() < deadline, "never pinned"
                s.send(X)
                sent += 1
                await s.recv(timeout=WAIT)
                await c.pump(0.01)
            before = c.pinned_replies
            s.send(X)
            got = await step(lambda: s.recv(timeout=WAIT))
            if got[0] == "Result":  # its frame number is how many went before the lease: timing
                assert got[2] == sent, (got, sent)
                got = (*got[:2], *got[3:])
            out.append(got)
            out.append(c.pinned_replies - before)
        deadline = time.monotonic() + WAIT
        while c.pinned("echo"):
            assert time.monotonic() < deadline, "still pinned"
            await c.pump(0.01)
        before = (c.direct_replies, c.pinned_replies)
        out.append(await step(lambda: c.infer("twin", BIG, timeout=WAIT)))
        out.append((c.direct_replies - before[0], c.pinned_replies - before[1]))
        out.append((c.stray_replies, c.broker_restarts, c.broker_reconnects, c.resent_calls))
        return out

    on_both(cl.frontend, scenario, timeout=WAIT)


# ----------------------------------------------------------------------------- no broker, a stopped one

def test_both_twins_without_a_broker(tmp_path):
    nobody = f"ipc://{tmp_path}/nobody.ipc"

    async def scenario(c):
        out = []
        out.append(await step(lambda: c.infer("echo", X)))
        out.append(await step(lambda: c.infer_stream("echo", X).result()))
        out.append(await step(lambda: c.mmi_service("echo")))
        out.append(await step(lambda: c.request("echo", [b"hi"])))
        s = c.stream("echo")
        s.send(X)
        out.append(await step(lambda: s.recv()))
        s.close()
        return out

    on_both(nobody, scenario, timeout=SHORT)

    async def silent(c):
        return [await step(lambda: c.infer("echo", X)), await step(lambda: c.mmi_service("echo"))]

    on_both(nobody, silent, timeout=None, heartbeat_interval=0.02)


def test_both_twins_with_a_stopped_broker(cl):
    async def scenario(c):
        out = [await step(lambda: c.mmi_service("echo", timeout=WAIT))]  # heard from
        os.kill(cl.spare.p.pid, signal.SIGSTOP)
        try:
            out.append(await step(lambda: c.infer("echo", X)))
            out.append(await step(lambda: c.infer_stream("echo", X).result()))
            out.append(await step(lambda: c.mmi_service("echo")))
            out.append(await step(lambda: c.request("echo", [b"hi"])))
            async with c.stream("echo") as s:
                s.send(X)
                out.append(await step(lambda: s.recv()))
            out.append(await step(lambda: c.pump(SHORT)))
        finally:
            os.kill(cl.spare.p.pid, signal.SIGCONT)
        return out

    on_both(cl.spare_frontend, scenario, timeout=SHORT)


def test_both_twins_across_a_broker_restart(cluster):
    brokers = [cluster.broker("--service-grace", "5")]
    cluster.worker("test_twin_parity:twin")

    async def scenario(c):
        out = [await step(lambda: c.infer("twin", X, timeout=WAIT)), c.broker_restarts]
        held = c.infer_stream("twin", slow(), timeout=WAIT)  # at the broker or its worker when it dies
        brokers[-1].kill()
        brokers.append(cluster.broker("--service-grace", "5"))  # on the same endpoint
        out.append(await step(lambda: held.result()))  # sent again, or answered straight by the worker
        out.append(await step(lambda: c.infer("twin", X, timeout=WAIT)))  # the worker joins the new one in time
        deadline = time.monotonic() + WAIT
        while c.broker_restarts == 0:
            assert time.monotonic() < deadline, "the restart went unnoticed"
            await c.pump(0.01)
        out.append(c.broker_restarts)
        out.append(await step(lambda: c.mmi_service("twin", timeout=WAIT)))
        return out

    on_both(cluster.frontend, scenario, timeout=WAIT, heartbeat_interval=HB)


def test_both_twins_when_the_socket_takes_nothing(tmp_path):
    """Nobody at the endpoint: the socket's queue fills, and a call whose request it will
    not take ends at its deadline (docs/client.md, `timeout`)."""
    nobody = f"ipc://{tmp_path}/nobody.ipc"

    async def scenario(c):
        call = None
        for _ in range(100_000):  # fill the socket
            call = c.prepare("echo", X, timeout=WAIT)
            if not c.submit(call) or (not isinstance(c, Blocking) and c._pending):
                break
        else:
            pytest.fail("the socket took 100000 requests")
        out = [await step(lambda: c.infer("echo", X))]
        out.append(await step(lambda: c.mmi_service("echo")))
        return out

    got = on_both(nobody, scenario, timeout=SHORT, heartbeat_interval=None, transport="inline", direct_reply=False)
    # DeadlineExceeded, as for a broker that takes the request and never answers (the
    # blocking twin raised BrokerUnreachable at the deadline; at the liveness window both
    # do: tests/e2e/test_silent_broker.py)
    assert [o[0] for o in got] == ["DeadlineExceeded", "DeadlineExceeded"], got


def test_both_twins_refuse_a_call_submitted_again_or_not_a_call(cl):
    """`submit` takes a call `prepare` made and nothing has sent: one submitted again (in
    flight, answered, given up) named input slots freed at its first FINAL, another call's
    by then, so the worker read that call's tensors (both twins accepted it).  Nor do
    `submit` and `give_up` take what is not a call (a raw AttributeError), nor a stream a
    `max_in_flight` that is not an int (1.5 and "2" were taken, as int())."""
    async def scenario(c):
        out = []
        call = c.prepare("echo", X, timeout=WAIT)
        out.append(await step(lambda: c.submit(call)))
        out.append(await step(lambda: c.submit(call)))  # in flight
        deadline = time.monotonic() + WAIT
        while not call.done:
            assert time.monotonic() < deadline, "no answer"
            await step(lambda: c.pump(0.05))
        out.append(await step(lambda: c.submit(call)))  # answered
        call.inbox.popleft()[1].release()
        gone = c.prepare("echo", X, timeout=WAIT)
        out.append(await step(lambda: c.give_up(gone)))
        out.append(await step(lambda: c.submit(gone)))  # given up
        for v in (None, "x"):
            out.append(await step(lambda: c.submit(v)))
            out.append(await step(lambda: c.give_up(v)))
        out.append(await step(lambda: c.stream("echo", max_in_flight=np.int64(2))))
        out.append(await step(lambda: c.infer("echo", X)))  # it serves on
        return out

    got = on_both(cl.frontend, scenario, timeout=WAIT)
    assert got[0] is True and got[3] is None and got[-2] == "Stream" and got[-1][0] == "Result", got
    assert {o[0] for o in got[1:3] + got[4:9]} == {"InvalidInput"}, got
