"""What docs/client.md promises a user of the SDK, checked as a user reads it, where no test
checked it yet, on both twins (`Client`, `AsyncClient`); no broker (an ipc endpoint with
nobody behind it: these promises hold before anything is sent).  The promises that need a
broker and workers are in tests/e2e/test_client_docs.py."""
from __future__ import annotations

import asyncio
import gc
import inspect
import math
import pathlib
import re
import warnings

import numpy as np
import pytest

import client_sdk
from client_sdk import (AsyncClient, Client, EndOfStream, InferenceError, InvalidInput, Priority,
                        StreamStats)

CLIENT_MD = pathlib.Path(client_sdk.__file__).parent.parent / "docs" / "client.md"
X = {"x": np.zeros(2, np.float32)}


def _documented_signatures() -> dict[str, list[tuple[str, str | None, bool]]]:
    """The "Clients" section's method bullets, ``- `name(args) -> T```: name -> [(parameter,
    default or None when none is written, keyword-only)]; a default written "..." is None."""
    out = {}
    for name, args in re.findall(r"^- `(\w+)\(([^`]*?)\)(?: -> [^`]+)?`", CLIENT_MD.read_text(), re.M):
        if args.strip() == "..." or name in out:  # (the first is the method's own bullet)
            continue
        params, kwonly = [], False
        for part in re.split(r",\s*", " ".join(args.split())) if args.strip() else ():
            if part == "*":
                kwonly = True
                continue
            pname, _, default = part.partition("=")
            params.append((pname, None if default in ("", "...") else default, kwonly))
        out[name] = params
    return out


def test_the_method_signatures_in_client_md_are_the_code_s():
    """Every method bullet of docs/client.md ("Clients", "Seams") names the parameters of both
    twins' method in order, keyword-only where it writes `*`, with the defaults it writes
    (a user copies calls from there)."""
    documented = _documented_signatures()
    # What the page lists, so that a bullet reworded out of the pattern fails here.
    assert {"infer", "request", "mmi_service", "alloc", "stream", "close", "in_flight", "pinned", "prepare",
            "submit", "give_up", "pump"} <= set(documented), sorted(documented)
    for cls in (Client, AsyncClient):
        for name, params in documented.items():
            sig = inspect.signature(getattr(cls, name))
            code = [p for p in sig.parameters.values() if p.name != "self"]
            assert [p.name for p in code] == [p for p, _, _ in params], f"{cls.__name__}.{name}{sig}"
            for p, (_, default, kwonly) in zip(code, params):
                assert (p.kind is p.KEYWORD_ONLY) == kwonly, f"{cls.__name__}.{name}: {p.name}"
                if default is not None:
                    assert p.default == eval(default), f"{cls.__name__}.{name}: {p.name}={p.default!r}"


def _closed_calls(c):
    """Every call docs/client.md says a closed client refuses ("this client is closed...")."""
    arr = np.zeros(2, np.float32)
    return {"infer": lambda: c.infer("echo", X), "infer_stream": lambda: c.infer_stream("echo", X),
            "stream": lambda: c.stream("echo"), "request": lambda: c.request("echo", [b"a"]),
            "mmi_service": lambda: c.mmi_service("echo"), "prepare": lambda: c.prepare("echo", X),
            "pump": lambda: c.pump(0), "alloc": lambda: c.alloc((2,), np.float32), "free": lambda: c.free(arr)}


def test_a_closed_client_refuses_every_call_and_closes_again_quietly(tmp_path):
    """"A call made after it (`infer`, `infer_stream`, `stream`, `request`, `mmi_service`,
    `prepare`, `pump`, `alloc`, `free`) raises `InferenceError` ("this client is closed...")
    before anything is sent; `close()` again does nothing" (and `aclose` is `close`)."""
    ep = f"ipc://{tmp_path}/nobody.ipc"
    c = Client(ep, heartbeat_interval=None)
    c.close()
    c.close()
    assert c.closed
    for name, call in _closed_calls(c).items():
        with pytest.raises(InferenceError, match="this client is closed") as e:
            call()
        assert not isinstance(e.value, InvalidInput), name

    async def twin():
        a = AsyncClient(ep, heartbeat_interval=None)
        await a.close()
        await a.close()
        await a.aclose()
        assert a.closed
        for name, call in _closed_calls(a).items():
            with pytest.raises(InferenceError, match="this client is closed") as e:
                got = call()
                if inspect.isawaitable(got):
                    await got
            assert not isinstance(e.value, InvalidInput), name

    asyncio.run(twin())


def test_a_client_collected_unclosed_says_so_with_a_resource_warning(tmp_path):
    """"A client collected unclosed says so with a `ResourceWarning` (ignored unless warnings
    are on)", on both twins, and a closed one says nothing."""
    ep = f"ipc://{tmp_path}/nobody.ipc"

    def collected(make) -> list:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            c = make()
            del c
            gc.collect()
        return [w for w in seen if issubclass(w.category, ResourceWarning)]

    def made(close: bool = False):
        c = Client(ep, heartbeat_interval=None)
        c.alloc((4,), np.float32)  # its input pool is made: it goes with the client
        if close:
            c.close()
        return c

    # Our own, naming the client and its endpoint (as Python's files do), not only pyzmq's
    # "Unclosed socket <zmq.Socket(zmq.DEALER) at 0x...>", which named neither.
    said = [str(w.message) for w in collected(made)]
    assert f"unclosed Client ({ep}): close it (client.close(), or with)" in said, said
    assert not collected(lambda: made(close=True))

    async def twin():
        said = [str(w.message) for w in collected(lambda: AsyncClient(ep, heartbeat_interval=None))]
        assert any(m.startswith(f"unclosed AsyncClient ({ep}): close it") for m in said), said

    asyncio.run(twin())


def test_the_pool_of_a_closed_client_is_refused_as_its_calls_are(tmp_path):
    """"A call made after it (..., the `pool` attribute, ...) raises `InferenceError` ("this
    client is closed...")": on both twins, whether or not the pool was made before the close
    (not the closed pool itself, nor a new one made for a closed client)."""
    ep = f"ipc://{tmp_path}/nobody.ipc"
    for made in (False, True):
        c = Client(ep, heartbeat_interval=None)
        if made:
            c.alloc((4,), np.float32)
        c.close()
        with pytest.raises(InferenceError, match="this client is closed"):
            c.pool

    async def twin():
        for made in (False, True):
            c = AsyncClient(ep, heartbeat_interval=None)
            if made:
                c.alloc((4,), np.float32)
            await c.close()
            with pytest.raises(InferenceError, match="this client is closed"):
                c.pool

    asyncio.run(twin())


def _bad_stream_options():
    return [dict(timeout=0), dict(timeout=-1), dict(timeout=math.nan), dict(timeout="1"),
            dict(priority="high"), dict(priority=3), dict(reply="bogus"), dict(meta=[1]),
            dict(meta={1: "a"}), dict(meta={"a": 1 << 70}), dict(meta={"a": "\ud800"}),
            dict(meta={"a": "x" * (64 << 10)})]


@pytest.mark.parametrize("pin", [None, False])
def test_a_stream_checks_its_options_when_it_opens(tmp_path, pin):
    """`stream(service, *, ..., timeout=None, priority=..., meta=..., reply=...)` takes the
    options of `infer` for each of its frames, and what `infer` refuses with `InvalidInput`
    (a timeout of 0, negative or NaN, an unknown priority or reply, a meta that is not a dict
    of str keys or cannot be sent) it refuses when it opens, as it does a bad `max_in_flight`
    or a closed client.  It opened, and every `send()` raised it instead (a camera loop
    failing each frame); a NaN timeout and a str one were taken even with `pin=None` (the
    docs hunt).  Service names too: the stream's frames cannot go anywhere else."""
    ep = f"ipc://{tmp_path}/nobody.ipc"
    with Client(ep, timeout=5) as c:
        for bad in _bad_stream_options():
            with pytest.raises(InvalidInput):
                c.stream("echo", pin=pin, **bad)
        for service in ("", "\ud800", b"echo", "mmi.service"):
            with pytest.raises(InvalidInput):
                c.stream(service, pin=pin)
        # What it takes: the documented values.
        for ok in (dict(timeout=None), dict(timeout=math.inf), dict(timeout=1e300), dict(priority=Priority.URGENT),
                   dict(priority=2), dict(priority="background"), dict(reply="inline"), dict(meta={"k": [1, "v"]})):
            c.stream("echo", pin=pin, **ok).close()
        assert c.in_flight() == 0

    async def twin():
        async with AsyncClient(ep, timeout=5) as a:
            for bad in _bad_stream_options():
                with pytest.raises(InvalidInput):
                    a.stream("echo", pin=pin, **bad)
            a.stream("echo", pin=pin, timeout=1e300, priority=0, meta={"k": 1}).close()

    asyncio.run(twin())


def test_options_and_fresh_objects_are_what_client_md_says(tmp_path):
    """The values the options table and the method list give, on both twins: `uses_shm` by
    transport; priorities by name, `Priority` or 0/1/2; `reply` modes; a `traceparent` that
    does not parse is ignored, one that is not a str refused; `heartbeat_interval` None or 0
    (off) or from 0.001 up, finite; `linger` finite >= 0; a stream `pin=True` without
    heartbeats refused; a fresh stream's `recv()` is `EndOfStream` and its `stats()` has
    every documented count; `alloc()`/`free()` of an `AsyncClient` need no loop."""
    ep = f"ipc://{tmp_path}/nobody.ipc"
    for cls in (Client, AsyncClient):
        for transport, shm in (("auto", True), ("shm", True), ("inline", False)):
            c = cls(ep, transport=transport, heartbeat_interval=None)
            assert c.uses_shm is shm and c.endpoint == ep and not c.closed
            assert c.in_flight() == 0 and not c.pinned("echo")
            assert (c.direct_replies, c.pinned_replies, c.stray_replies, c.broker_restarts, c.broker_reconnects,
                    c.resent_calls) == (0, 0, 0, 0, 0, 0)
            asyncio.run(c.close()) if cls is AsyncClient else c.close()
        tcp = cls("tcp://127.0.0.1:1", insecure=True, heartbeat_interval=None)
        assert not tcp.uses_shm  # "auto": inline over tcp
        asyncio.run(tcp.close()) if cls is AsyncClient else tcp.close()
        for bad in (dict(heartbeat_interval=0.0009), dict(heartbeat_interval=math.inf),
                    dict(heartbeat_interval=-1), dict(linger=-1), dict(linger=math.inf), dict(linger=math.nan),
                    dict(pin=0), dict(pin=1.5), dict(pin=65537), dict(pin=np.True_), dict(pin="3"),
                    dict(transport="bogus")):
            with pytest.raises(InvalidInput):
                cls(ep, **bad)
        for ok in (dict(heartbeat_interval=0), dict(heartbeat_interval=0.001), dict(linger=0), dict(pin=3), dict(pin=65536),
                   dict(pin=np.int64(3))):  # numpy's ints, as pool_capacity and max_in_flight take them
            c = cls(ep, **ok)
            asyncio.run(c.close()) if cls is AsyncClient else c.close()
    assert (Priority.URGENT, Priority.NORMAL, Priority.BACKGROUND) == (0, 1, 2)
    with Client(ep, heartbeat_interval=None) as c:
        for p in ("urgent", "normal", "background", Priority.URGENT, Priority.BACKGROUND, 0, 1, 2):
            c.give_up(c.prepare("echo", X, priority=p))
        for p in (3, -1, "high", None, 1.0):
            with pytest.raises(InvalidInput, match="priority"):
                c.prepare("echo", X, priority=p)
        for r in ("auto", "shm", "inline"):
            c.give_up(c.prepare("echo", X, reply=r))
        c.give_up(c.prepare("echo", X, traceparent="not a traceparent"))
        for bad in (b"00-", 1):
            with pytest.raises(InvalidInput, match="traceparent"):
                c.prepare("echo", X, traceparent=bad)
        with pytest.raises(InvalidInput):
            c.stream("echo", pin=True)  # heartbeats off
        with c.stream("echo", pin=False) as s:
            with pytest.raises(EndOfStream):
                s.recv(timeout=0)
            st = s.stats()
            assert isinstance(st, StreamStats)
            assert (st.sent, st.completed, st.failed, st.dropped, st.in_flight, st.pending, st.cancelled,
                    list(st.latencies_ms)) == (0, 0, 0, 0, 0, 0, 0, [])
            assert s.max_in_flight == 2 and s.unfinished() == frozenset()
        buf = c.alloc((3, 4), np.float32)
        assert buf.flags.writeable and buf.shape == (3, 4) and buf.dtype == np.float32
        view = buf[1:]
        del buf
        gc.collect()
        assert c.pool.in_use() == 1  # a view keeps it
        del view
        gc.collect()
        assert c.pool.in_use() == 0
    a = AsyncClient(ep, heartbeat_interval=None)
    try:
        a.free(a.alloc((4,), np.float32))  # no loop: none needed
        with pytest.raises(InvalidInput):
            a.stream("echo", pin=True)
    finally:
        asyncio.run(a.close())
