"""What the worker makes of a factory's result (docs/models.md, "Loading a custom model",
tests/e2e/wrapped_model.py): a TorchScript module serves as an nn.Module does.  Real broker
and workers on ipc; every wait bounded.  (A factory that cannot load is one line and exit 2:
tests/gpu_worker/test_models.py, with the worker's own process.)"""
from __future__ import annotations

import numpy as np
import pytest

from client_sdk import Client
from tests.e2e.conftest import wait_service

pytestmark = pytest.mark.timeout(120)

WAIT = 20.0


def test_a_scripted_module_serves_as_a_module(cluster):
    # `requires_grad_` refused it at load, a traceback and exit 1 (the models audit).
    cluster.broker()
    w = cluster.worker("wrapped_model:scripted", "--log-level", "INFO")  # the service: its class's name
    w.wait_log("warm-up of scale on cpu took")
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "scale")
        for n in (1, 3):
            x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
            with c.infer("scale", {"x": x}) as r:
                np.testing.assert_array_equal(r["output"], x * 2 + 1)
    assert w.p.poll() is None

