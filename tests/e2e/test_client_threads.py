"""A blocking `Client` shared by threads (docs/client.md: it is not thread-safe): refused with
`InvalidInput`, not interleaved.  Four threads on one client used to split multipart messages
between them, fail most calls and leave calls and pool slots held for good.  Real broker and
worker on ipc; every wait bounded."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from client_sdk import Client
from client_sdk.errors import InvalidInput

pytestmark = pytest.mark.timeout(120)


def test_a_second_thread_is_refused_while_one_is_inside_the_client(cluster):
    cluster.broker()
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        assert c.mmi_service("echo")
        inside = threading.Thread(target=c.pump, args=(3.0,))  # waits for traffic that never comes
        inside.start()
        deadline = time.monotonic() + 10
        while not c._user:  # (its thread claimed the client)
            assert time.monotonic() < deadline, "the pump never started"
            time.sleep(0.001)
        with pytest.raises(InvalidInput, match="another thread"):
            c.infer("echo", {"x": np.ones(4)})
        with pytest.raises(InvalidInput, match="another thread"):
            c.infer_stream("echo", {"x": np.ones(4)})
        with pytest.raises(InvalidInput, match="another thread"):
            c.mmi_service("echo")
        inside.join(10)
        assert not inside.is_alive()
        with c.infer("echo", {"x": np.arange(4.0)}) as r:  # the first thread's turn is over: anyone's
            np.testing.assert_array_equal(r["x"], np.arange(4.0))


def test_threads_sharing_a_client_get_a_typed_error_and_lose_nothing(cluster):
    cluster.broker()
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        assert c.mmi_service("echo")
        start = threading.Barrier(4, timeout=10)
        counts = {"ok": 0, "refused": 0, "other": []}
        lock = threading.Lock()

        def run(k):
            start.wait()
            for i in range(150):
                x = np.full(64, k * 1000 + i, dtype=np.int64)
                try:
                    with c.infer("echo", {"x": x}) as r:
                        np.testing.assert_array_equal(r["x"], x)  # never another's reply
                    key = "ok"
                except InvalidInput:
                    key = "refused"
                except Exception as e:  # anything else is a failure of the guard
                    with lock:
                        counts["other"].append(repr(e))
                    continue
                with lock:
                    counts[key] += 1

        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert counts["other"] == [] and counts["ok"] + counts["refused"] == 600, counts
        assert c.in_flight() == 0  # no call left held
        for i in range(50):  # and it serves on, from one thread
            with c.infer("echo", {"x": np.arange(i + 1)}) as r:
                np.testing.assert_array_equal(r["x"], np.arange(i + 1))
