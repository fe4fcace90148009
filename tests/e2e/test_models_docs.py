"""What docs/models.md says a client gets from a streaming model's errors, on the wire (the
rest of the doc's promises to a model's author are tests/gpu_worker/test_models_docs.py's):
`gpu_worker.models.InvalidInput` is the request's `422 INVALID_INPUT` (the client raises
`InvalidInput`) when it comes before any partial; what a streaming model raises after
partials, `InvalidInput` and `sys.exit()` included, fails its request `500 INTERNAL ... after
N partial result(s)`, and the worker serves on.  Real broker and worker on ipc."""
from __future__ import annotations

import numpy as np
import pytest

from client_sdk import Client
from client_sdk.errors import InternalError, InvalidInput
from tests.e2e.conftest import wait_service

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0


def _stream(c: Client, x: np.ndarray) -> list:
    with c.infer_stream("docstream", {"x": x}, timeout=WAIT) as h:
        return [np.array(r["y"]) for r in h if "y" in r]


def test_a_streaming_models_errors_reach_the_client_as_the_doc_says(cluster):
    cluster.broker()
    w = cluster.worker("docs_model:stream")  # the service is the model's name
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "docstream")
        with pytest.raises(InvalidInput, match="x\\[0\\] = -1 is refused") as info:
            _stream(c, np.array([-1, 0], np.float32))
        # It ran and refused them: not "the model did not run", a signature mismatch's words.
        assert "refused them as it ran" in str(info.value) and "did not run" not in str(info.value)
        with pytest.raises(InternalError, match="InvalidInput after 2 partial result"):
            _stream(c, np.array([-2, 0], np.float32))
        with pytest.raises(InternalError, match="SystemExit after 1 partial result"):
            _stream(c, np.array([-3, 0], np.float32))
        x = np.array([5, 6], np.float32)
        parts = _stream(c, x)  # and the worker serves on
        assert [p.tolist() for p in parts] == [(x + i).tolist() for i in range(3)]
    assert w.p.poll() is None
