"""What the worker makes of a factory's result (docs/models.md, "Loading a custom model",
tests/e2e/wrapped_model.py): a TorchScript module serves as an nn.Module does, and a
TorchScript function and a `torch.export` program as torch models (tensors in and out); a function
that returns no dict gets its request a 500 that says the same request fails the same way;
a model without example inputs is said to skip its warm-up.  Real broker and workers on ipc;
every wait bounded.  (A factory that cannot load is one line and exit 2:
tests/gpu_worker/test_models.py, with the worker's own process.)"""
from __future__ import annotations

import numpy as np
import pytest

from client_sdk import Client
from client_sdk.errors import InternalError, InvalidInput
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


def test_a_scripted_function_serves_as_a_torch_model(cluster):
    # It was wrapped as a numpy callable and called with the dict of arrays: its warm-up
    # failed, and with --no-warmup every request was a 500 ("Expected a value of type
    # 'Tensor' for argument 'x' but instead found type 'dict'").
    cluster.broker()
    w = cluster.worker("wrapped_model:scripted_fn", "--log-level", "INFO")  # the service: the function's name
    w.wait_log("warm-up of negate on cpu took")
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "negate")
        for n in (1, 3):
            x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
            with c.infer("negate", {"x": x}) as r:
                np.testing.assert_array_equal(r["output"], -x)
    assert w.p.poll() is None


def test_a_torch_export_program_serves_as_a_torch_model(cluster):
    # Callable, it was wrapped as a numpy callable: every request failed ("Unable to call
    # ExportedProgram directly").  Its warm-up is its own example inputs.
    cluster.broker()
    w = cluster.worker("wrapped_model:exported", "--log-level", "INFO")  # the service: the factory's name
    w.wait_log("warm-up of exported on cpu took")
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "exported")
        for k in range(3):  # one item each: dimension 0 is the batch the worker makes
            x = np.arange(3, dtype=np.float32) * k
            with c.infer("exported", {"x": x}) as r:
                np.testing.assert_array_equal(r["output"], x * 2 - 1)
        # A shape it was not exported for: the request's 422, not the model's 500.
        with pytest.raises(InvalidInput, match="does not take these inputs"):
            c.infer("exported", {"x": np.ones((2, 3), np.float32)})
    assert w.p.poll() is None


def test_a_function_returning_no_dict_fails_its_request_as_the_models_mistake(cluster):
    # A plain TypeError: answered "model 'picky' raised TypeError ... (retrying may help)".
    cluster.broker()
    w = cluster.worker("wrapped_model:picky", "--log-level", "INFO")
    # It has no example inputs: its warm-up was logged as one of 0.0 ms.
    w.wait_log("warm-up of picky skipped: the model has no example_inputs()")
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "picky")
        with pytest.raises(InternalError) as e:
            with c.infer("picky", {"x": np.array([-1.0, 2.0], np.float32)}):
                pass
        words = str(e.value)
        assert "no reply can carry" in words and "the same request fails the same way" in words, words
        assert "returned list; expected a dict" in words and "retrying" not in words, words
        x = np.array([1.0, 2.0], np.float32)
        with c.infer("picky", {"x": x}) as r:  # and the worker serves on
            np.testing.assert_array_equal(r["y"], x + 1)
    assert w.p.poll() is None
    assert "took 0.0 ms" not in w.stderr(None)
