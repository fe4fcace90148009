"""Our worker and client behind a broker that speaks RFC 18 and nothing more
(tests/e2e/plain_mdp_broker.py): no WELCOME, no DONE, no client heartbeats."""
from __future__ import annotations

import numpy as np
import pytest

from client_sdk import Client
from tests.e2e.conftest import Proc, wait_service

pytestmark = pytest.mark.timeout(120)


def test_our_worker_replies_through_a_plain_broker_request_after_request(tmp_path):
    # Found by the version-skew hunt: the worker sent its first FINAL straight to our client
    # (reply_to) and told the broker DONE, which a plain broker does not know: it kept the
    # worker busy for good, and every later request waited out its deadline.  A worker
    # replies directly only to a broker that sent it WELCOME.
    fe, be = f"ipc://{tmp_path}/fe.ipc", f"ipc://{tmp_path}/be.ipc"
    procs = [Proc(["-m", "plain_mdp_broker", fe, be])]
    try:
        procs[0].wait_ready()
        procs.append(Proc(["-m", "gpu_worker", "--broker", be, "--model", "echo", "--heartbeat-interval", "0.2"]))
        procs[1].wait_ready()
        with Client(fe, timeout=10, heartbeat_interval=None) as c:
            wait_service(c, "echo")
            for i in range(5):
                x = np.full(16, i, np.float32)
                with c.infer("echo", {"x": x}) as r:
                    np.testing.assert_array_equal(r["x"], x)
            assert c.direct_replies == 0
        assert "unknown worker command" not in procs[0].stderr()
    finally:
        for p in reversed(procs):
            p.close()
