"""A stock `torch.nn.Sequential` served end to end (issue 14: it used to get the whole input
dict and die in warm-up): a real `python -m gpu_worker --model seq_model:sequential` behind a
real broker, called through the SDK with its one input named "image", then "x" (the name
does not matter for a single-input module).  Skipped without torch (the 3.12 CI venv)."""
from __future__ import annotations

import numpy as np
import pytest

from client_sdk import Client
from tests.e2e.conftest import wait_service

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0


def test_an_nn_sequential_is_served_whatever_its_input_is_called(cluster):
    pytest.importorskip("torch", reason="the model is a torch.nn.Sequential (pip install '.[torch]')")
    cluster.broker()
    cluster.worker("seq_model:sequential", "--service", "seq")
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "seq")
        for name in ("image", "x"):
            x = np.arange(12, dtype=np.float32).reshape(3, 4)
            with c.infer("seq", {name: x}, timeout=WAIT) as r:
                assert list(r) == ["output"]
                np.testing.assert_array_equal(r["output"], x[:, :2] * 2)
