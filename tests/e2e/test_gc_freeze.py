"""End to end: `python -m broker` and `python -m gpu_worker` freeze their startup heap before
they serve (broker.protocol.heap; what a full collection then costs: `bench.gc_pause`)."""
from __future__ import annotations

import numpy as np
import pytest

from client_sdk import Client

pytestmark = pytest.mark.timeout(60)


def test_the_broker_and_the_worker_freeze_their_startup_heap_and_serve(cluster):
    b = cluster.broker("--log-level", "INFO")
    b.wait_log("startup heap frozen")
    w = cluster.worker("echo", "--log-level", "INFO")
    w.wait_log("startup heap frozen")
    log = w._err.decode(errors="replace")
    assert log.index("warm-up of echo") < log.index("startup heap frozen")  # after the model warmed up
    with Client(cluster.frontend, timeout=10) as c:
        x = np.arange(8, dtype=np.float32)
        with c.infer("echo", {"x": x}) as r:
            assert np.array_equal(r["x"], x)
