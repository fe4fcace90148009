"""What docs/client.md promises a user of the SDK about answers (results, reply handles,
streams, `request`, `mmi_service`), checked as a user reads it, where no test checked it yet:
one broker and its workers (echo, chunks: a service that streams, and the gate model, which
holds a request until the test lets it go), many checks per twin.  The promises that need no
broker are in tests/client_sdk/test_client_docs.py."""
from __future__ import annotations

import asyncio
import collections.abc
import math

import numpy as np
import pytest

from client_sdk import (AsyncClient, Client, DeadlineExceeded, EndOfStream, NotSupported, Result,
                        ServiceUnavailable)

from .conftest import wait_service

WAIT = 20.0
BIG = np.arange(100_000, dtype=np.float32)   # 400 KB: through shared memory both ways
SMALL = np.arange(4, dtype=np.float32)       # 16 B: inline both ways ("auto")
TIMING = ("queue_ms", "batch_wait_ms", "input_ms", "compute_ms", "output_ms", "batch", "client_ms")


def _check_result(r: Result, sent: np.ndarray, what: str) -> None:
    """"A `Result` is a read-only mapping name -> `np.ndarray`, with `timing`, `id`, `seq`,
    `final` ...  Output arrays are always read-only" (`flags.writeable = True` refused,
    whatever the transport); `timing` has the broker's and worker's numbers and `client_ms`
    on a FINAL, and `returned` only when the request was taken back."""
    assert isinstance(r, collections.abc.Mapping) and not isinstance(r, collections.abc.MutableMapping), what
    with pytest.raises(TypeError):
        r["y"] = sent  # type: ignore[index]
    assert list(r) == ["x"] and r.final is True and r.seq == 0 and isinstance(r.id, int), what
    assert set(TIMING) <= set(r.timing) and "returned" not in r.timing, (what, r.timing)
    out = r["x"]
    assert isinstance(out, np.ndarray) and not out.flags.writeable, what
    with pytest.raises(ValueError):
        out.flags.writeable = True
    np.testing.assert_array_equal(out, sent)


def _cluster(cluster, gate):
    cluster.broker("--service-grace", "0")  # an unknown service fails at once
    gated = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--no-warmup",
                           env=gate.env, wait=False)
    others = [cluster.worker(m, wait=False) for m in ("echo", "chunks")]
    gate.open()
    for p in (gated, *others):
        p.wait_ready()


def test_answers_are_what_client_md_says_on_both_twins(cluster, gate):
    _cluster(cluster, gate)
    with Client(cluster.frontend, timeout=WAIT) as c:
        for s in ("echo", "chunks", "gate"):
            wait_service(c, s)
        # mmi_service -> bool; request -> list[bytes] (an echo hands the frames back).
        assert c.mmi_service("echo") is True and c.mmi_service("nosuch") is False
        assert c.request("echo", [b"ab", b"cd"]) == [b"ab", b"cd"]
        # Results, by every path an output takes.
        for x, reply in ((BIG, "auto"), (SMALL, "auto"), (BIG, "inline"), (SMALL, "shm")):
            with c.infer("echo", {"x": x}, reply=reply) as r:
                _check_result(r, x, f"{x.nbytes} B, reply={reply}")
        assert c.direct_replies > 0  # an ipc client: its FINALs skipped the broker
        # "no worker serves the service" (no grace at this broker).
        with pytest.raises(ServiceUnavailable):
            c.infer("nosuch", {"x": SMALL})
        # A handle: result(timeout) that passes is TimeoutError, not DeadlineExceeded, and the
        # request stays in flight (0 or less: no wait); its Result's id is its request_id;
        # once the FINAL was taken, or the handle failed, result() raises EndOfStream.
        h = c.infer_stream("gate", {"x": SMALL})
        gate.wait_entered(1)
        for wait in (0.05, 0, -1):
            with pytest.raises(TimeoutError) as e:
                h.result(timeout=wait)
            assert not isinstance(e.value, DeadlineExceeded), wait
        assert c.in_flight() == 1
        gate.release()
        with h.result(timeout=WAIT) as r:
            _check_result(r, SMALL, "handle")
            assert r.id == h.request_id
        with pytest.raises(EndOfStream):
            h.result()
        assert h.cancel() is False and not h.cancelled  # its FINAL had arrived
        failed = c.infer_stream("nosuch", {"x": SMALL})
        with pytest.raises(ServiceUnavailable):
            failed.result(timeout=WAIT)
        with pytest.raises(EndOfStream):
            failed.result()
        # A service that streams: infer and result() raise NotSupported; iterating gives every
        # PARTIAL, then the FINAL; a stream's frame fails with NotSupported.
        with pytest.raises(NotSupported):
            c.infer("chunks", {"x": SMALL})
        with pytest.raises(NotSupported):
            c.infer_stream("chunks", {"x": SMALL}).result(timeout=WAIT)
        with c.infer_stream("chunks", {"x": SMALL}) as h:
            parts = list(h)
            assert len(parts) > 1 and [p.final for p in parts] == [False] * (len(parts) - 1) + [True]
            assert [p.seq for p in parts] == list(range(len(parts)))
            with pytest.raises(EndOfStream):
                h.result()
        with c.stream("chunks", latest_wins=False, pin=False) as s:
            s.send({"x": SMALL})
            with pytest.raises(NotSupported):
                s.recv(timeout=WAIT)
        # Streams: results in send order, `frame` the number send() returned; EndOfStream
        # when nothing is outstanding; the counts add up.
        with c.stream("echo", latest_wins=False, max_in_flight=2) as s:
            frames = [s.send({"x": np.full(3, i, np.float32)}) for i in range(5)]
            got = [s.recv(timeout=WAIT) for _ in frames]
            assert [g.frame for g in got] == frames and [int(g["x"][0]) for g in got] == list(range(5))
            for g in got:
                g.release()
            with pytest.raises(EndOfStream):
                s.recv(timeout=0)
            st = s.stats()
            assert st.sent == st.completed + st.failed + st.in_flight + st.cancelled == 5
            assert len(st.latencies_ms) == 5
        # recv(timeout): TimeoutError when nothing arrived (0 or less: no wait), the frame
        # stays in flight.
        with c.stream("gate", pin=False) as s:
            s.send({"x": SMALL})
            gate.wait_entered(2)
            for wait in (0.05, 0, -1):
                with pytest.raises(TimeoutError) as e:
                    s.recv(timeout=wait)
                assert not isinstance(e.value, DeadlineExceeded), wait
            assert s.stats().in_flight == 1
            gate.release()
            s.recv(timeout=WAIT).release()
    with Client(cluster.frontend, timeout=WAIT, direct_reply=False) as c:
        c.infer("echo", {"x": BIG}).release()
        assert c.direct_replies == 0  # "`False`: every reply through the broker"
    with Client(cluster.frontend, timeout=WAIT, transport="inline") as c:
        with c.infer("echo", {"x": BIG}) as r:
            _check_result(r, BIG, "inline client")

    async def twin() -> None:
        # timeout=1e300 (or math.inf) is taken by every wait of AsyncClient too.
        async with AsyncClient(cluster.frontend, timeout=1e300) as a:
            assert await a.mmi_service("echo", timeout=1e300) is True
            assert await a.mmi_service("nosuch") is False
            assert await a.request("echo", [b"ab"], timeout=math.inf) == [b"ab"]
            for x in (BIG, SMALL):
                with await a.infer("echo", {"x": x}, timeout=1e300) as r:
                    _check_result(r, x, f"async {x.nbytes} B")
            with pytest.raises(ServiceUnavailable):
                await a.infer("nosuch", {"x": SMALL})
            h = a.infer_stream("gate", {"x": SMALL}, timeout=1e300)
            await asyncio.to_thread(gate.wait_entered, 3)
            for wait in (0.05, 0, -1):
                with pytest.raises(TimeoutError) as e:
                    await h.result(timeout=wait)
                assert not isinstance(e.value, DeadlineExceeded), wait
            assert a.in_flight() == 1
            gate.release()
            with await h.result(timeout=1e300) as r:
                _check_result(r, SMALL, "async handle")
                assert r.id == h.request_id
            with pytest.raises(EndOfStream):
                await h.result()
            assert h.cancel() is False
            failed = a.infer_stream("nosuch", {"x": SMALL})
            with pytest.raises(ServiceUnavailable):
                await failed.result(timeout=WAIT)
            with pytest.raises(EndOfStream):
                await failed.result()
            with pytest.raises(NotSupported):
                await a.infer("chunks", {"x": SMALL})
            with pytest.raises(NotSupported):
                await a.infer_stream("chunks", {"x": SMALL}).result(timeout=WAIT)
            h = a.infer_stream("chunks", {"x": SMALL})
            parts = [p async for p in h]
            assert len(parts) > 1 and parts[-1].final and not parts[0].final
            with pytest.raises(EndOfStream):
                await h.result()
            s = a.stream("echo", latest_wins=False, timeout=1e300, pin=False)
            frames = [s.send({"x": np.full(3, i, np.float32)}) for i in range(4)]
            s.finish()
            got = [r async for r in s]
            assert [g.frame for g in got] == frames and [int(g["x"][0]) for g in got] == list(range(4))
            with pytest.raises(EndOfStream):
                await s.recv(timeout=0)
            s.close()
            s = a.stream("gate", pin=False)
            s.send({"x": SMALL})
            await asyncio.to_thread(gate.wait_entered, 4)
            for wait in (0.05, 0, -1):
                with pytest.raises(TimeoutError) as e:
                    await s.recv(timeout=wait)
                assert not isinstance(e.value, DeadlineExceeded), wait
            gate.release()
            (await s.recv(timeout=WAIT)).release()
            s.close()
            s = a.stream("chunks", latest_wins=False, pin=False)
            s.send({"x": SMALL})
            with pytest.raises(NotSupported):
                await s.recv(timeout=WAIT)
            s.close()

    asyncio.run(twin())
