"""The CPU-testable parts of the TensorRT backend: the engine cache key and location, and
the ONNX export with a dynamic batch axis (needs the onnx package; skipped without it)."""
from __future__ import annotations

import importlib.util

import pytest

from gpu_worker import trt

KEY = dict(model="cartoon", weights="w1", gpu_name="NVIDIA H200", compute_capability=(9, 0),
           trt_version="10.3.0", inputs=[("image", "|u1", (1080, 1920, 3))], profile=(1, 4, 8), fp16=False)


def test_engine_key_is_stable_and_sensitive():
    k = trt.engine_key(**KEY)
    assert k == trt.engine_key(**KEY) and len(k) == 24
    changes = dict(model="convnet", weights="w2", gpu_name="NVIDIA A100", compute_capability=(8, 0),
                   trt_version="10.4.0", inputs=[("image", "|u1", (720, 1280, 3))], profile=(1, 4, 16), fp16=True)
    for field, value in changes.items():
        assert trt.engine_key(**dict(KEY, **{field: value})) != k, field
    # Input order does not matter; the set does.
    two = [("a", "<f4", (3,)), ("b", "|u1", (4,))]
    assert trt.engine_key(**dict(KEY, inputs=two)) == trt.engine_key(**dict(KEY, inputs=two[::-1]))


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert trt.cache_dir() == tmp_path / "zmq-infer" / "trt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert trt.cache_dir().parts[-3:] == (".cache", "zmq-infer", "trt")
    assert trt._engine_path("my/model", "abc", tmp_path).name == "my_model-abc.engine"


def test_weights_digest_tracks_weights():
    pytest.importorskip("torch", reason="the digest is of a torch module's weights")
    from gpu_worker.models import load_model

    a = trt.weights_digest(load_model("convnet", "cpu").net)
    assert a == trt.weights_digest(load_model("convnet", "cpu").net)
    from gpu_worker.models import ConvNetModel

    assert a != trt.weights_digest(ConvNetModel(seed=1).net)


def test_available_reports_a_reason():
    ok, why = trt.available()
    assert isinstance(ok, bool) and why
    if importlib.util.find_spec("tensorrt") is None:
        assert not ok and "TensorRT is not installed" in why


@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason=trt.ONNX_MISSING + " (not installed here)")
@pytest.mark.parametrize("name", ["cartoon", "convnet"])
def test_onnx_export_has_a_dynamic_batch_axis(name, tmp_path):
    import numpy as np

    torch = pytest.importorskip("torch", reason="the export traces a torch model")

    from gpu_worker.models import load_model

    model = load_model(name, "cpu")
    frame = np.zeros((64, 96, 3), np.uint8)
    example = {"image": torch.from_numpy(np.stack([frame, frame]))}
    path = tmp_path / f"{name}.onnx"
    ins, outs = trt.export_onnx(model, path, example=example)
    assert ins == ["image"]
    dims = trt.onnx_io_dims(path)
    assert dims["image"][0] == "batch" and dims["image"][1:] == [64, 96, 3]
    out_name = "image__out" if name == "cartoon" else "logits"
    assert dims[out_name][0] == "batch"
