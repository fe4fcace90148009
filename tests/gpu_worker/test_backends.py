"""Backends: stacking, zero-copy conversion, splitting, devices, and an unavailable TensorRT."""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest

from gpu_worker.backends import (
    TENSORRT_MISSING,
    BackendError,
    BackendUnavailable,
    CallableBackend,
    TorchBackend,
    make_backend,
    numpy_to_torch,
    warmup,
)
from gpu_worker.devices import DeviceError, DeviceUnavailable, cuda_available, resolve_device
from gpu_worker.models import ModelBase, load_model

torch = pytest.importorskip("torch")


def readonly(a):
    a = np.array(a)
    a.flags.writeable = False  # what a client's shared-memory slot looks like to the worker
    return a


def ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class Spy(ModelBase):
    """Records what the model was handed; returns x + 1 and a per-item sum."""

    name = "spy"

    def __init__(self, framework="torch"):
        self.framework = framework
        self.seen = []

    def __call__(self, batch):
        x = batch["x"]
        self.seen.append(x)
        if self.framework == "torch":
            assert torch.is_inference_mode_enabled()
            return {"y": x + 1, "s": x.reshape(x.shape[0], -1).sum(1)}
        return {"y": x + 1, "s": x.reshape(x.shape[0], -1).sum(1)}


# ------------------------------------------------------------------------------ correctness


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_outputs_are_correct_per_request(framework):
    model = Spy(framework)
    backend = make_backend(model, "cpu")
    assert isinstance(backend, TorchBackend if framework == "torch" else CallableBackend)
    reqs = [{"x": readonly(np.full((2, 3), i, np.float32))} for i in range(4)]
    outs = backend.run(reqs)
    assert len(outs) == 4
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out["y"], np.full((2, 3), i + 1, np.float32))
        assert out["s"].shape == () and out["s"] == 6 * i
        assert isinstance(out["y"], np.ndarray) and not out["y"].flags.writeable
    assert backend.run([]) == []


def test_cartoon_and_convnet_through_the_backend_match_direct_calls():
    for name, shape, out_name in [("cartoon", (40, 56, 3), "image"), ("convnet", (64, 64, 3), "logits")]:
        model = load_model(name, "cpu")
        backend = make_backend(model, "cpu")
        rng = np.random.default_rng(0)
        reqs = [{"image": readonly(rng.integers(0, 256, shape, dtype=np.uint8))} for _ in range(3)]
        outs = backend.run(reqs)
        with torch.inference_mode():
            direct = model({"image": torch.from_numpy(np.stack([r["image"] for r in reqs]))})[out_name].numpy()
        for i, out in enumerate(outs):
            np.testing.assert_allclose(out[out_name], direct[i], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ zero copy


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_batch_of_one_hands_the_request_memory_to_the_model(framework):
    model = Spy(framework)
    backend = make_backend(model, "cpu")
    x = readonly(np.arange(12, dtype=np.float32).reshape(3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable" warning either
        backend.run([{"x": x}])
    seen = model.seen[-1]
    assert tuple(seen.shape) == (1, 3, 4)
    if framework == "torch":
        assert isinstance(seen, torch.Tensor) and seen.data_ptr() == ptr(x)
    else:
        assert np.shares_memory(seen, x)
    assert not x.flags.writeable  # no writable alias was made of the read-only input


def test_numpy_to_torch_shares_memory_for_readonly_and_writable_arrays():
    for a in (readonly(np.arange(6, dtype=np.int16).reshape(2, 3)), np.arange(6.0)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            t = numpy_to_torch(a)
        assert t.data_ptr() == ptr(a) and tuple(t.shape) == a.shape
    strided = readonly(np.arange(20, dtype=np.float32).reshape(4, 5))[:, ::2]
    t = numpy_to_torch(strided)
    assert t.data_ptr() == ptr(strided) and torch.equal(t, torch.tensor(np.ascontiguousarray(strided)))
    # Layouts torch cannot alias still convert (by copying).
    swapped = np.arange(4, dtype=">i4")
    assert numpy_to_torch(swapped).tolist() == [0, 1, 2, 3]
    with pytest.raises(BackendError, match="no torch equivalent"):
        numpy_to_torch(np.array(["a"]))


def test_readonly_conversion_does_not_warn_in_a_fresh_process():
    # torch warns about non-writable arrays once per process, so an in-process check can
    # pass only because some earlier test used up the warning: check in a new interpreter.
    import subprocess
    import sys

    code = ("import numpy as np; from gpu_worker.backends import numpy_to_torch\n"
            "a = np.arange(4.0); a.flags.writeable = False\n"
            "assert numpy_to_torch(a).data_ptr() == a.ctypes.data\n")
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_readonly_conversion_without_dlpack_support_still_shares_memory(monkeypatch):
    def old_numpy(arr):  # numpy < 2.1 cannot export read-only arrays over DLPack
        raise BufferError("Cannot export readonly array since signalling readonly is unsupported by DLPack.")

    monkeypatch.setattr(torch, "from_dlpack", old_numpy)
    a = readonly(np.arange(6, dtype=np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = numpy_to_torch(a)
    assert t.data_ptr() == ptr(a)


def test_echo_batch_of_one_returns_a_view_of_the_input():
    model = load_model("echo", "cpu")
    x = readonly(np.arange(5, dtype=np.uint8))
    for backend in (make_backend(model, "cpu"), TorchBackend(model, "cpu")):
        out = backend.run([{"x": x}])[0]["x"]
        assert ptr(out) == ptr(x) and not out.flags.writeable


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_per_request_outputs_are_views_of_one_batch_output(framework):
    backend = make_backend(Spy(framework), "cpu")
    reqs = [{"x": readonly(np.full((4, 5), i, np.float32))} for i in range(3)]
    outs = backend.run(reqs)
    ys = [o["y"] for o in outs]
    item = ys[0].nbytes
    for i, y in enumerate(ys):
        assert not y.flags.owndata
        assert ptr(y) == ptr(ys[0]) + i * item  # consecutive rows of one array
        assert y.base is ys[0].base


def test_staging_buffer_is_reused_but_never_under_an_output_that_aliases_it():
    spy = Spy("numpy")
    backend = make_backend(spy, "cpu")
    reqs = [{"x": readonly(np.full(3, i, np.float32))} for i in range(2)]
    backend.run(reqs)
    backend.run(reqs)
    assert ptr(spy.seen[0]) == ptr(spy.seen[1])  # one buffer for both batches

    echo = load_model("echo", "cpu")
    backend = make_backend(echo, "cpu")
    first = backend.run(reqs)
    second = backend.run([{"x": readonly(np.full(3, 7, np.float32))} for _ in range(2)])
    assert first[0]["x"].tolist() == [0, 0, 0] and first[1]["x"].tolist() == [1, 1, 1]
    assert second[0]["x"].tolist() == [7, 7, 7]


def test_incompatible_requests_are_refused():
    backend = make_backend(Spy(), "cpu")
    with pytest.raises(BackendError, match="not stack-compatible"):
        backend.run([{"x": np.zeros(3, np.float32)}, {"x": np.zeros(4, np.float32)}])
    with pytest.raises(BackendError, match="not stack-compatible"):
        backend.run([{"x": np.zeros(3, np.float32)}, {"x": np.zeros(3, np.float64)}])


def test_output_without_batch_axis_is_an_error():
    class Bad(ModelBase):
        name = "bad"
        framework = "numpy"

        def __call__(self, batch):
            return {"y": np.zeros(5)}

    with pytest.raises(BackendError, match="leading batch axis of 2"):
        make_backend(Bad(), "cpu").run([{"x": np.zeros(1)}] * 2)


@pytest.mark.parametrize("n", [1, 2])
def test_a_model_returning_what_is_not_a_dict_is_said_as_such(n):
    # A list (or a bare array) failed as an AttributeError from deep in the backend, blamed
    # on the model as an error that "retrying may help".
    from gpu_worker.backends import BadOutputs

    class Listing(ModelBase):
        name = "listing"
        framework = "numpy"

        def __call__(self, batch):
            return [batch["x"] + 1]

    with pytest.raises(BadOutputs, match="'listing' returned list; expected a dict of outputs"):
        make_backend(Listing(), "cpu").run([{"x": np.zeros(1)}] * n)


@pytest.mark.parametrize("n", [1, 2])
def test_an_ndarray_subclass_output_splits_as_a_plain_array(n):
    # np.matrix stays 2-d when indexed: each request's (3,) output came out (1, 3).
    class Matrix(ModelBase):
        name = "matrix"
        framework = "numpy"

        def __call__(self, batch):
            return {"y": np.asmatrix(np.arange(3 * n, dtype=np.float64).reshape(n, 3)),
                    "r": np.rec.array(np.zeros(n, [("a", "<i4")]))}

    outs = make_backend(Matrix(), "cpu").run([{"x": np.zeros(1)}] * n)
    for i, out in enumerate(outs):
        assert type(out["y"]) is np.ndarray and out["y"].shape == (3,), out["y"]
        assert out["y"].tolist() == [3.0 * i, 3.0 * i + 1, 3.0 * i + 2]
        assert out["r"].shape == () and out["r"].dtype.itemsize == 4


def test_non_batchable_model_runs_once_per_request():
    spy = Spy()
    spy.batchable = False
    outs = make_backend(spy, "cpu").run([{"x": np.full(2, i, np.float32)} for i in range(3)])
    assert [o["y"].tolist() for o in outs] == [[1, 1], [2, 2], [3, 3]]
    assert [tuple(t.shape) for t in spy.seen] == [(1, 2)] * 3


def test_streaming_model_yields_partials_in_order():
    model = load_model("chunks", "cpu")
    x = readonly(np.arange(10, dtype=np.int64))
    for backend in (make_backend(model, "cpu"), TorchBackend(model, "cpu")):
        parts = [p["x"] for p in backend.run_stream({"x": x})]
        assert len(parts) == 4
        np.testing.assert_array_equal(np.concatenate(parts), x)
        with pytest.raises(BackendError, match="run_stream"):
            backend.run([{"x": x}])


def test_torch_streaming_steps_run_in_inference_mode_but_the_caller_does_not():
    class TorchStream(ModelBase):
        name = "ts"
        streaming = True

        def __call__(self, batch):
            for i in range(3):
                assert torch.is_inference_mode_enabled()
                yield {"y": batch["x"] * i}

    states = []
    for out in TorchBackend(TorchStream(), "cpu").run_stream({"x": np.ones(2, np.float32)}):
        states.append(torch.is_inference_mode_enabled())
    assert states == [False, False, False]


def test_numpy_backend_refuses_torch_models():
    with pytest.raises(BackendError, match="numpy backend"):
        CallableBackend(Spy("torch"))
    with pytest.raises(BackendError, match="unknown backend"):
        make_backend(Spy(), "cpu", kind="onnx")


def test_warmup_runs_example_inputs_for_each_size():
    spy = Spy("numpy")
    spy.example_inputs = lambda: {"x": np.zeros(3, np.float32)}
    timings = warmup(make_backend(spy, "cpu"), spy, [1, 4, 4])
    assert sorted(timings) == [1, 4]
    assert [len(t) for t in spy.seen] == [1, 4]
    assert warmup(make_backend(Spy("numpy"), "cpu")) == {}  # no example inputs: skipped
    chunks = load_model("chunks", "cpu")
    assert list(warmup(make_backend(chunks, "cpu"), chunks, [1, 8])) == [1]  # not batchable


# ------------------------------------------------------------------------------ devices, TensorRT


def test_resolve_device():
    assert resolve_device("cpu") == "cpu" and resolve_device(" CPU ") == "cpu"
    assert resolve_device(None) == resolve_device("auto") == ("cuda:0" if cuda_available() else "cpu")
    with pytest.raises(DeviceError, match="expected 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device("tpu")
    if not cuda_available():
        with pytest.raises(DeviceUnavailable, match="CUDA is not available"):
            resolve_device("cuda")
        with pytest.raises(DeviceUnavailable):
            TorchBackend(Spy(), "cuda:0")
    else:
        assert resolve_device("cuda") == "cuda:0"
        with pytest.raises(DeviceUnavailable, match="visible"):
            resolve_device("cuda:999")


def test_cuda_available_never_raises(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert cuda_available() is False
    with pytest.raises(DeviceUnavailable, match="torch is not installed"):
        resolve_device("cuda:0")
    assert resolve_device("auto") == "cpu"


def test_auto_on_a_machine_without_a_gpu_does_not_import_torch(tmp_path, monkeypatch):
    import subprocess
    import sys

    from gpu_worker import devices

    # With a GPU device node present, "auto" asks torch (which may still say no).
    node = tmp_path / "nvidiactl"
    node.write_text("")
    monkeypatch.setattr(devices, "_GPU_NODES", (str(node),))
    asked = []
    monkeypatch.setattr(devices, "cuda_available", lambda: asked.append(1) or False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert resolve_device("auto") == "cpu" and asked == [1]
    # Without one, it does not: in a fresh interpreter, torch is never imported.
    monkeypatch.setattr(devices, "_GPU_NODES", (str(tmp_path / "none"),))
    assert resolve_device("auto") == "cpu" and asked == [1]
    monkeypatch.undo()
    root = str(Path(__file__).resolve().parents[2])
    code = ("import sys; from gpu_worker.devices import _no_gpu_here, resolve_device; "
            "print(_no_gpu_here(), resolve_device('auto'), 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root)
    no_gpu, device, imported = r.stdout.split()
    if no_gpu == "True":  # this machine (CI's too) has no GPU device node
        assert (device, imported) == ("cpu", "False"), r.stderr


def test_tensorrt_is_unavailable_without_tensorrt():
    from gpu_worker import trt

    if trt.available()[0]:
        pytest.skip("TensorRT is usable here")
    with pytest.raises(BackendUnavailable) as info:
        make_backend(Spy(), "cuda:0", kind="tensorrt")
    if importlib.util.find_spec("tensorrt") is None:
        assert str(info.value) == TENSORRT_MISSING
        assert "pip install '.[gpu]'" in str(info.value)


# --------------------------------------------------------------------------- request meta


def _scaler(record: list):
    def fn(batch, meta):
        record.append(meta)
        scale = np.array([m.get("scale", 1) for m in meta] if isinstance(meta, list) else [meta.get("scale", 1)])
        return {"y": batch["x"] * scale.reshape(-1, *([1] * (batch["x"].ndim - 1)))}
    return fn


def test_callable_declaring_meta_gets_a_list_per_batch_in_order():
    from gpu_worker.models import CallableModel

    seen: list = []
    backend = CallableBackend(CallableModel(_scaler(seen), name="scaler"))
    assert backend.takes_meta
    x = np.ones(3, np.float32)
    outs = backend.run([{"x": x}, {"x": x}, {"x": x}], meta=[{"scale": 2}, {"scale": 3}, {}])
    assert seen == [[{"scale": 2}, {"scale": 3}, {}]]
    assert [float(o["y"][0]) for o in outs] == [2.0, 3.0, 1.0]
    # A batch of one is still a batch: a list of one.  No meta given: empty dicts.
    backend.run([{"x": x}], meta=[{"scale": 5}])
    backend.run([{"x": x}])
    assert seen[1:] == [[{"scale": 5}], [{}]]


def test_unbatched_and_streaming_models_get_one_dict():
    from gpu_worker.models import CallableModel

    seen: list = []
    fn = _scaler(seen)
    fn.batchable = False
    backend = CallableBackend(CallableModel(fn, name="one"))
    x = np.ones(2, np.float32)
    outs = backend.run([{"x": x}, {"x": x}], meta=[{"scale": 4}, {"scale": 6}])
    assert seen == [{"scale": 4}, {"scale": 6}]
    assert [float(o["y"][0]) for o in outs] == [4.0, 6.0]

    got = []

    def chunks(batch, *, meta):
        got.append(meta)
        for _ in range(meta["k"]):
            yield {"x": batch["x"]}
    chunks.streaming = True
    backend = CallableBackend(CallableModel(chunks, name="chunks"))
    assert len(list(backend.run_stream({"x": x}, meta={"k": 3}))) == 3
    assert got == [{"k": 3}]


def test_models_without_meta_are_called_as_before():
    from gpu_worker.models import CallableModel

    calls = []

    def plain(batch):
        calls.append(batch)
        return {"y": batch["x"]}

    def kw_only(batch, **kwargs):  # **kwargs is not a declaration: nothing extra is passed
        calls.append(kwargs)
        return {"y": batch["x"]}

    x = np.ones(2, np.float32)
    for fn in (plain, kw_only):
        backend = CallableBackend(CallableModel(fn, name="plain"))
        assert not backend.takes_meta
        assert backend._meta_call is None
        backend.run([{"x": x}, {"x": x}], meta=[{"a": 1}, {"a": 2}])  # ignored
        backend.run([{"x": x}])
    assert calls[2:] == [{}, {}]


def test_model_class_declaring_meta_in_call():
    class Scale(ModelBase):
        name = "scale"
        framework = "numpy"

        def __call__(self, batch, meta=None):
            return {"y": batch["x"] * np.array([m["scale"] for m in meta], np.float32)[:, None]}

    backend = CallableBackend(Scale())
    assert backend.takes_meta
    x = np.ones(2, np.float32)
    outs = backend.run([{"x": x}, {"x": x}], meta=[{"scale": 2}, {"scale": 3}])
    assert [o["y"].tolist() for o in outs] == [[2.0, 2.0], [3.0, 3.0]]


def test_torch_module_forward_declaring_meta():
    from gpu_worker.models import TorchModuleModel

    class Scale(torch.nn.Module):
        def forward(self, x, *, meta):
            return x * torch.tensor([m.get("scale", 1) for m in meta], dtype=x.dtype)[:, None]

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x + 1

    backend = TorchBackend(TorchModuleModel(Scale(), name="scale"))
    assert backend.takes_meta
    x = np.ones(2, np.float32)
    outs = backend.run([{"x": x}, {"x": x}], meta=[{"scale": 3}, {}])
    assert [o["output"].tolist() for o in outs] == [[3.0, 3.0], [1.0, 1.0]]
    (one,) = backend.run([{"x": x}], meta=[{"scale": 7}])
    assert one["output"].tolist() == [7.0, 7.0]
    # One tensor goes positionally whatever its name, as without meta (it went as a dict:
    # "'dict' object has no attribute 'dtype'", the models audit), and many names stay bounded.
    (img,) = backend.run([{"image": x}], meta=[{"scale": 5}])
    assert img["output"].tolist() == [5.0, 5.0]
    from gpu_worker.models import MAX_CALL_STYLES

    for i in range(MAX_CALL_STYLES + 5):
        (o,) = backend.run([{f"n{i}": x}], meta=[{}])
        assert o["output"].tolist() == [1.0, 1.0]

    plain = TorchBackend(TorchModuleModel(Plain(), name="plain"))
    assert not plain.takes_meta
    (out,) = plain.run([{"x": x}], meta=[{"scale": 7}])
    assert out["output"].tolist() == [2.0, 2.0]


def test_torch_outputs_with_lazy_conj_or_neg_bits_come_back_and_bfloat16_says_what_to_do():
    # numpy cannot take a tensor whose conjugate or negative bit is set (t.conj(), some
    # complex math): it failed as the model's own error, "retrying may help" (found by the
    # data hunt).  bfloat16 has no numpy dtype: the model is told to convert it.
    torch = pytest.importorskip("torch")
    from gpu_worker.backends import BackendError, _to_numpy

    t = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    np.testing.assert_array_equal(_to_numpy(t.conj(), "y"), np.array([1 - 2j, 3 + 4j], np.complex64))
    np.testing.assert_array_equal(_to_numpy(torch._neg_view(t), "y"), -t.numpy())
    with pytest.raises(BackendError, match="bfloat16.*no numpy dtype.*float"):
        _to_numpy(torch.ones(2, dtype=torch.bfloat16), "y")
    # A sparse one is blamed on its layout, not its dtype (float32 has a numpy dtype).
    with pytest.raises(BackendError, match="sparse_coo torch tensor: numpy takes dense ones.*to_dense"):
        _to_numpy(torch.eye(2).to_sparse(), "y")


def test_a_streaming_callable_that_returns_one_dict_streams_it_as_its_one_partial():
    """As a streaming ModelBase's dict is: a plain function with streaming = True that
    returned a dict had its keys iterated ("returned str", the models audit)."""
    from gpu_worker.models import CallableModel

    def once(batch):
        return {"y": batch["x"] + 1}
    once.streaming = True

    def once_meta(batch, *, meta):
        return {"y": batch["x"] + meta.get("k", 0)}
    once_meta.streaming = True
    x = np.arange(3, dtype=np.float32)
    for fn, meta, want in ((once, None, x + 1), (once_meta, {"k": 5}, x + 5)):
        (part,) = list(CallableBackend(CallableModel(fn, name="once")).run_stream({"x": x}, meta=meta))
        np.testing.assert_array_equal(part["y"], want)
