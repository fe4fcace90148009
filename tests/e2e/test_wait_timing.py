"""Every wait a brokered request had shows in its reply's timing (docs/client.md, "Results
and their lifetime"), against the real processes: a request dispatched to a worker whose
loop thread is inside another request's batch waits there, and its `batch_wait_ms` counts
that wait from the moment the worker read it (its heartbeat thread reads while the loop
computes), not from when the loop got round to it - the issue's "queue 0 ms, batch wait
0.1 ms" after a 1 s wait.

The model is tests/e2e/gate_model.py's `held`: its warm-up is fast, so its batches run on
the worker loop's own thread, and a call with x[0] < 0 is held until the test releases it
(the `gate` fixture).  Every wait polls a condition with a timeout; the one fixed interval is
how long the test keeps the first request held, which it checks the second waited through.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from client_sdk import Client

from .test_metrics import scrape, until, value

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0
HOLD = 2.0  # seconds the first request stays held after the second reached the worker


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_a_wait_behind_a_loop_thread_batch_shows_in_batch_wait_ms(cluster, tmp_path, gate):
    log = tmp_path / "runs.log"
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    cluster.worker("gate_model:held", "--credit", "2", env={"SLEEPY_LOG": str(log), **gate.env})
    gate.open()
    with Client(cluster.frontend, timeout=WAIT) as c:
        first = c.infer_stream("held", {"x": np.array([-1.0])}, timeout=50.0)  # held until released
        until(lambda: len(_lines(log)) == 1, "the first request started")
        sent = time.monotonic()
        second = c.infer_stream("held", {"x": np.array([0.0])})
        assert c.mmi_service("held")  # a barrier: the broker has the second request
        # It went to the worker (credit 2), where it waits behind the first's batch.
        until(lambda: value(scrape(base), "zmq_infer_in_flight", service="held") == 2, "the second request dispatched to the busy worker")
        with pytest.raises(TimeoutError):  # not answered while the first is held...
            second.result(timeout=HOLD)
        gate.release(1)
        res_first = first.result(timeout=WAIT)
        res_second = second.result(timeout=WAIT)
        took_ms = (time.monotonic() - sent) * 1e3
        t = res_second.timing
        try:
            # ...and its timing shows that wait: at the worker, behind the batch on its loop thread.
            assert t["batch_wait_ms"] >= HOLD * 1e3 - 100, t
            waits = t.get("queue_ms", 0.0) + t["batch_wait_ms"]
            assert HOLD * 1e3 - 100 <= waits <= took_ms + 50, (t, took_ms)
            # The wait is not counted as its compute (it would be HOLD and more); bounds
            # of half of HOLD leave a loaded machine room.
            assert t["compute_ms"] < HOLD * 1e3 / 2, t
            assert res_first.timing["batch_wait_ms"] < HOLD * 1e3 / 2, res_first.timing  # the first never waited
        finally:
            res_first.release()
            res_second.release()
