"""A client that fell back to inline because no worker on its host could map its shared
memory returns to shared memory once such a worker exists (issue 14, docs/client.md)."""
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
