"""A broker and its workers stopped together, then continued (one ``docker pause`` of the
stack, a Ctrl-Z of the launcher's process group): neither presumes the other dead at the
thaw for a silence that was its own.  Monotonic clocks run while a process is stopped, so
without the correction each side found the other silent past its liveness window the
moment it ran again: the broker reported the worker dead and sent its requests again, and
the worker reconnected (a false `worker_deaths`, a retry, leases ended).

Real processes, SIGSTOP and SIGCONT; the pause is the stimulus (its length is what is
tested), every wait for an outcome is a condition with a timeout."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from client_sdk import Client

from .conftest import wait_service
from .test_metrics import scrape, value

pytestmark = pytest.mark.timeout(90)

HEARTBEAT = 0.3  # the broker's liveness window: 3 intervals, 0.9 s
PAUSE = 2.0      # more than twice the window
STAGGER = 0.3    # one continued this long before the other: within the window


def _pause_together(procs, first, then) -> None:
    for p in procs:
        os.kill(p.p.pid, signal.SIGSTOP)
    time.sleep(PAUSE)  # the stimulus: how long both are stopped
    os.kill(first.p.pid, signal.SIGCONT)
    time.sleep(STAGGER)  # the stimulus: the other still stopped this long
    os.kill(then.p.pid, signal.SIGCONT)


def test_a_broker_and_worker_stopped_together_keep_each_other_and_the_running_request(cluster, gate):
    broker = cluster.broker("--http", "127.0.0.1:0", "--heartbeat-interval", str(HEARTBEAT))
    base = "http://" + broker.field("http")
    worker = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--no-warmup",
                            env=gate.env, wait=False)
    gate.open()
    worker.wait_ready()
    x = np.arange(16, dtype=np.float32)
    with Client(cluster.frontend, timeout=30) as c:
        wait_service(c, "gate")
        for n, (first, then) in enumerate(((worker, broker), (broker, worker))):
            h = c.infer_stream("gate", {"x": x + n})  # held at the gate while both are stopped
            _pause_together((broker, worker), first, then)
            gate.release()
            assert np.array_equal(h.result(timeout=20)["x"], x + n)
            h.close()
        # One more request after the thaws: the same worker, registered all along.
        gate.release()
        assert np.array_equal(c.infer("gate", {"x": x}, timeout=20)["x"], x)
    m = scrape(base)
    assert value(m, "zmq_infer_broker_events_total", event="paused") >= 2
    assert value(m, "zmq_infer_broker_events_total", event="worker_deaths") == 0
    assert value(m, "zmq_infer_broker_events_total", event="retried") == 0
    worker.terminate()
    assert "reconnecting" not in worker.stderr(None)
    broker.terminate()
    assert "presumed dead" not in broker.stderr(None)
