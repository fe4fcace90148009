"""A client that fell back to inline because no worker on its host could map its shared
memory returns to shared memory once such a worker exists (issue 14, docs/client.md).

What shows the path a request took: its input is a `client.alloc` buffer, sent by
reference when it goes by shared memory, and the echo model hands its input back, so its
reply then names the client's own slot and the output is a view of that very buffer
(`np.shares_memory`, `Result.zero_copy`); an inline request's output is a copy in a frame."""
from __future__ import annotations

import time

import numpy as np

from client_sdk import Client
from tests.e2e.conftest import wait_service


def test_the_inline_fallback_switches_back_once_a_local_worker_exists(cluster):
    cluster.broker()
    cluster.worker("echo", "--transports", "inline")  # serves the service, but not our memory
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        x = np.arange(2048, dtype=np.float32)  # 8 KiB: above P.SMALL_INLINE_BYTES, so by shared memory
        with c.infer("echo", {"x": x}) as r:  # NOT_LOCAL, resent inline, transparently
            np.testing.assert_array_equal(r["x"], x)
        assert "echo" in c._core.not_local
        cluster.worker("echo")  # now one that maps shared memory
        deadline = time.monotonic() + 20
        while "echo" in c._core.not_local:  # each try is a real request; the backoff is 1-2 s
            assert time.monotonic() < deadline, "the client never tried shared memory again"
            with c.infer("echo", {"x": x}) as r:
                np.testing.assert_array_equal(r["x"], x)
            time.sleep(0.05)
        # Back on shared memory: the request goes as a descriptor, and keeps doing so.
        for _ in range(20):
            with c.infer("echo", {"x": x}) as r:
                np.testing.assert_array_equal(r["x"], x)
        assert "echo" not in c._core.not_local
        # ... really: the worker read the buffer in place and echoed its location.
        buf = c.alloc(x.shape, x.dtype)
        buf[:] = x
        for _ in range(3):
            with c.infer("echo", {"x": buf}) as r:
                np.testing.assert_array_equal(r["x"], x)
                assert r.zero_copy == {"x": True} and np.shares_memory(r["x"], buf), r.timing
        c.free(buf)


def test_an_inline_fallback_reply_is_a_copy(cluster):
    """The observable of the test above, seen the other way: while the only worker cannot
    map our memory, the same request is resent inline and its output is a copy."""
    cluster.broker()
    cluster.worker("echo", "--transports", "inline")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        buf = c.alloc((2048,), np.float32)
        buf[:] = np.arange(2048, dtype=np.float32)
        with c.infer("echo", {"x": buf}) as r:  # NOT_LOCAL, resent inline
            np.testing.assert_array_equal(r["x"], buf)
            assert r.zero_copy == {"x": False} and not np.shares_memory(r["x"], buf)
        assert "echo" in c._core.not_local
        c.free(buf)
