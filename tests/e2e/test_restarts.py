"""Restarts with real processes: the broker SIGKILLed and started again on the same endpoints,
and workers stopped with SIGTERM while they hold requests (docs/operations.md)."""
from __future__ import annotations

import time

import numpy as np

from client_sdk import Client
from tests.e2e.conftest import wait_service


def _echo_round(c: Client, n: int) -> None:
    for i in range(n):
        x = np.full(16, i % 251, np.uint8)
        with c.infer("echo", {"x": x}, timeout=10) as r:
            np.testing.assert_array_equal(r["x"], x)


def test_workers_survive_a_broker_restart_within_the_liveness_window(cluster):
    broker = cluster.broker()
    workers = [cluster.worker("echo"), cluster.worker("echo")]
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        _echo_round(c, 20)
    broker.kill()  # SIGKILL: no goodbye to anyone
    t0 = time.monotonic()
    cluster.broker()  # same endpoints, well inside the workers' 0.6 s liveness window
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        back_after = time.monotonic() - t0
        _echo_round(c, 20)
    assert all(w.p.poll() is None for w in workers), [w.stderr() for w in workers]
    assert back_after < 10.0, back_after


def test_workers_survive_a_broker_restart_past_the_liveness_window(cluster):
    broker = cluster.broker()
    worker = cluster.worker("echo")
    broker.kill()
    worker.wait_log("reconnecting")  # it noticed the silence and reconnects with nobody there
    cluster.broker()
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        _echo_round(c, 5)
    assert worker.p.poll() is None, worker.stderr()
