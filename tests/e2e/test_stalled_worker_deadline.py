"""A leased request that waited in a stalled worker's input (SIGSTOP here: a GC pause, a
frozen container) past its deadline is never run: the worker counted `timeout_ms` from its
own receipt, so a request it read late got its whole budget again, and ran at once (the
lone-request lane), for a caller whose deadline had passed (the timeouts hunt's left-over:
no broker times a leased request).  A worker now takes the
client's `deadline_at` as the broker does, for a client on its clock, and answers 504.

Real processes; the worker's stop is the stimulus (its length is what is tested), every wait
for an outcome is a condition with a timeout.  That the request never ran is shown by the
model's run log: `held` writes a line when it starts a call with x != 0."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from client_sdk import Client, DeadlineExceeded

from .conftest import wait_service

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 0.3
STALL = 0.6  # the worker's stop: past the deadline, well within its liveness window at the broker


def test_a_leased_request_read_after_its_deadline_never_runs(cluster, tmp_path):
    cluster.broker()
    log = tmp_path / "runs.log"
    os.mkfifo(tmp_path / "gate.fifo")
    w = cluster.worker("gate_model:held", "--service", "s", "--max-batch", "1", "--direct",
                       env={"SLEEPY_LOG": str(log), "GATE_FIFO": str(tmp_path / "gate.fifo")})
    with Client(cluster.frontend, timeout=10, pin=True) as c:
        wait_service(c, "s")
        deadline = time.monotonic() + 20
        while not c.pinned("s"):  # the lease is granted at the first request, answered meanwhile
            assert time.monotonic() < deadline, "no lease on s"
            c.infer("s", {"x": np.array([0.0])}).release()
        os.kill(w.p.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            h = c.infer_stream("s", {"x": np.array([0.05])}, timeout=TIMEOUT)
            assert h._call.pin is not None, "sent on the lease"
            # (Its caller not waiting yet, nothing stops it but its deadline: no CANCEL.)
            time.sleep(max(0.0, t0 + STALL - time.monotonic()))  # the stimulus: the stall's length
        finally:
            os.kill(w.p.pid, signal.SIGCONT)
        with c.infer("s", {"x": np.array([0.0])}, timeout=10) as r:  # the worker serves, in order
            assert r["x"][0] == 0.0
        with pytest.raises(DeadlineExceeded):
            h.result()
    assert not log.exists() or log.read_text() == "", "the expired request ran"
