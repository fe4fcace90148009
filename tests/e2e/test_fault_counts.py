"""Counts under faults (the counts hunt): each request counted once, with the outcome its
client saw, when a broker restarts under pinned traffic, a CANCEL races a result, or a
client's connection is replaced.  Real processes; every wait polls a condition."""
from __future__ import annotations

import time

import numpy as np
import pytest

from client_sdk import Client

from .conftest import wait_service
from .test_metrics import WAIT, _pin, scrape, until, value

pytestmark = pytest.mark.timeout(60)


def _outcomes(base: str, service: str) -> dict:
    return {dict(labels)["outcome"]: v for (name, labels), v in scrape(base).items()
            if name == "zmq_infer_requests_total" and dict(labels)["service"] == service}


def test_pinned_requests_run_while_the_broker_was_down_count_at_its_successor(cluster):
    """The broker is SIGKILLed while a client is pinned: the client's next calls still run on
    the lease (its worker is alive, its connection up) before anyone notices.  The worker
    counted them for its next STATS, which went into the dead broker's connection (or came
    to the new broker before the worker registered there, which drops a stranger's STATS):
    the restarted broker never counted them.  The worker now keeps what it counted until a
    broker that counts has registered it, and sends it then."""
    broker = cluster.broker("--http", "127.0.0.1:0")
    w = cluster.worker("echo", "--direct")
    x = {"x": np.arange(4)}
    with Client(cluster.frontend, timeout=WAIT, pin=True) as c:
        wait_service(c, "echo")
        _pin(c, "echo", x)
        broker.kill()  # SIGKILL: no goodbye, nothing flushed
        before = c.pinned_replies
        for _ in range(10):
            c.infer("echo", x).release()
        assert c.pinned_replies - before == 10, "the calls did not stay on the lease"
        broker = cluster.broker("--http", "127.0.0.1:0")
        base = "http://" + broker.field("http")
        until(lambda: value(scrape(base), "zmq_infer_credit", service="echo"), "the worker registered again")
        until(lambda: _outcomes(base, "echo").get("ok", 0) >= 10, "the pinned calls counted at the new broker",
              timeout=3.0)
    assert w.p.poll() is None
    assert _outcomes(base, "echo") == {"ok": 10}
