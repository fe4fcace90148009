"""TensorRT backend: ONNX export with a dynamic batch axis, an engine with one optimisation
profile (min/opt/max batch), engines cached on disk, execution with ``execute_async_v3``
on the worker's CUDA stream.

``tensorrt`` and ``onnx`` are imported lazily: this module imports on any machine, and
`available()` says why the backend cannot run where it cannot.

Pipeline, once per (model, input signature):

1. `export_onnx`: trace the model's ``__call__`` (dict in, dict out) through an adapter
   module with ``torch.onnx.export`` (the TorchScript exporter, ``dynamo=False``: it needs
   only the ``onnx`` package, and the shipped models are plain conv/elementwise graphs),
   every input and output getting a dynamic axis 0 named ``batch``.  Traced at batch 2, so
   no size-1 batch dimension is constant-folded into a broadcast.
2. `build_engine`: parse the ONNX file, one optimisation profile with batch min 1, opt and
   max as configured and the item shape fixed, optional FP16, serialise.
3. Cache: ``$XDG_CACHE_HOME/zmq-infer/trt/<model>-<key>.engine`` (default ``~/.cache``),
   where the key hashes the model name, a digest of its weights, the GPU name and compute
   capability, the TensorRT version, the input signature, the profile and the precision -
   everything that makes an engine invalid or different.  Written atomically, so two workers
   starting together never read half an engine; a file that fails to deserialise (a driver
   update) is rebuilt.
4. `TensorRTEngine.run`: set input shapes and tensor addresses (torch CUDA tensors, so the
   worker's CUDA IPC and pinned-memory paths feed it without copies), allocate outputs from
   the context's inferred shapes, ``execute_async_v3(stream)``; nothing waits on the host.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from gpu_worker.backends import BackendError, BackendUnavailable, TorchBackend, numpy_to_torch
from shm.cuda import cuda_status

log = logging.getLogger("gpu_worker.trt")

__all__ = [
    "available", "onnx_available", "cache_dir", "engine_key", "weights_digest", "export_onnx",
    "onnx_io_dims", "build_engine", "load_or_build", "TensorRTEngine", "TrtBackend",
]

TENSORRT_MISSING = ("TensorRT is not installed: pip install '.[gpu]' (tensorrt>=10) on a machine "
                    "with an NVIDIA GPU and a CUDA build of torch")
ONNX_MISSING = "the onnx package is not installed (torch.onnx.export needs it): pip install onnx"


def onnx_available() -> tuple[bool, str]:
    if importlib.util.find_spec("onnx") is None:
        return False, ONNX_MISSING
    return True, "ok"


def available() -> tuple[bool, str]:
    """(usable, reason) for building and running TensorRT engines here.  Never raises."""
    if importlib.util.find_spec("tensorrt") is None:
        return False, TENSORRT_MISSING
    ok, why = onnx_available()
    if not ok:
        return False, why
    ok, why = cuda_status()
    if not ok:
        return False, why
    try:
        import tensorrt  # noqa: F401
    except Exception as e:  # a wheel that does not match the driver or CUDA
        return False, f"tensorrt failed to import: {type(e).__name__}: {e}"
    return True, "ok"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zmq-infer" / "trt"


# --------------------------------------------------------------------------------------------
# Cache key

def weights_digest(module: Any) -> str:
    """blake2b of the module's parameters and buffers (names, dtypes, shapes, bytes): a
    retrained or reseeded model never reuses an old engine."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    state = module.state_dict() if hasattr(module, "state_dict") else {}
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():  # raw bytes, so dtypes numpy lacks (bfloat16) hash too
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def engine_key(*, model: str, weights: str, gpu_name: str, compute_capability: tuple[int, int],
               trt_version: str, inputs: Sequence[tuple[str, str, tuple]], profile: tuple[int, int, int],
               fp16: bool) -> str:
    """Hex key of everything an engine depends on.  `inputs`: (name, dtype str, item shape)."""
    doc = {
        "model": model, "weights": weights, "gpu": gpu_name, "cc": list(compute_capability),
        "trt": trt_version, "inputs": [[n, d, list(s)] for n, d, s in sorted(inputs)],
        "profile": list(profile), "fp16": bool(fp16), "format": 1,
    }
    return hashlib.blake2b(json.dumps(doc, sort_keys=True).encode(), digest_size=12).hexdigest()


def _engine_path(model: str, key: str, directory: Path | None = None) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)[:64]
    return (directory or cache_dir()) / f"{safe}-{key}.engine"


# --------------------------------------------------------------------------------------------
# ONNX export

def _adapter(model: Any, input_names: list[str], output_names: list[str]):
    import torch

    class DictAdapter(torch.nn.Module):
        """Positional tensors in, a tuple out: what the ONNX exporter traces."""

        def __init__(self):
            super().__init__()
            net = getattr(model, "net", None)
            if isinstance(net, torch.nn.Module):
                self.net = net  # registered, so the exporter sees its weights as initialisers

        def forward(self, *tensors):
            out = model(dict(zip(input_names, tensors)))
            return tuple(out[k] for k in output_names)

    return DictAdapter().eval()


def _example_items(model: Any) -> dict[str, np.ndarray]:
    """One item per input (no batch axis): the model's example inputs, which fix the shapes
    an engine is built for; BackendError when the model has none."""
    try:
        example = model.example_inputs()
    except NotImplementedError:
        raise BackendError(f"model {model.name!r} has no example_inputs(); "
                           "TensorRT needs them for the item shapes of its engine") from None
    if not isinstance(example, Mapping) or not example:
        raise BackendError(f"model {model.name!r}: example_inputs() returned {type(example).__name__}, "
                           "not a dict of input name -> one item (TensorRT builds its engine for those shapes)")
    return {k: np.asarray(v) for k, v in example.items()}


def _example_batch(model: Any, batch: int, device: str) -> dict[str, Any]:
    example = _example_items(model)
    out = {}
    for k, v in example.items():
        arr = np.ascontiguousarray(np.stack([np.asarray(v)] * batch))
        out[k] = numpy_to_torch(arr).to(device)
    return out


def export_onnx(model: Any, path: str | os.PathLike, *, example: Mapping[str, Any] | None = None,
                device: str = "cpu", opset: int = 17) -> tuple[list[str], list[str]]:
    """Export `model` (a torch model of gpu_worker.models: dict in, dict out) to ONNX with a
    dynamic batch axis on every input and output.  Returns (input names, output names).

    `example`: batched example tensors (default: the model's example inputs, batch 2)."""
    ok, why = onnx_available()
    if not ok:
        raise BackendUnavailable(why)
    import torch

    if example is None:
        example = _example_batch(model, 2, device)
    input_names = sorted(example)
    try:
        with torch.inference_mode():
            probe = model(dict(example))
    except Exception as e:
        raise BackendError(f"model {model.name!r} raised on its example inputs while being exported to ONNX "
                           f"for TensorRT: {type(e).__name__}: {e}") from e
    if not isinstance(probe, Mapping):
        raise BackendError(f"model {model.name!r} must return a dict of tensors to be exported")
    output_names = sorted(probe)
    clash = set(input_names) & set(output_names)
    # ONNX value names are global: an output called like an input ("image" -> "image")
    # gets a suffix in the graph and keeps its name at the API.
    onnx_out = [f"{k}__out" if k in clash else k for k in output_names]
    dyn = {k: {0: "batch"} for k in input_names + onnx_out}
    module = _adapter(model, input_names, output_names)
    try:
        with torch.no_grad():
            torch.onnx.export(module, tuple(example[k] for k in input_names), os.fspath(path),
                              input_names=input_names, output_names=onnx_out, dynamic_axes=dyn,
                              opset_version=opset, do_constant_folding=True, dynamo=False)
    except Exception as e:  # an op the exporter cannot trace: the model cannot run on TensorRT
        raise BackendError(f"model {model.name!r} cannot be exported to ONNX for TensorRT: "
                           f"{type(e).__name__}: {e}") from e
    return input_names, output_names


def onnx_io_dims(path: str | os.PathLike) -> dict[str, list[int | str]]:
    """name -> dims of every graph input and output (ints, or the symbolic name)."""
    ok, why = onnx_available()
    if not ok:
        raise BackendUnavailable(why)
    import onnx

    m = onnx.load(os.fspath(path), load_external_data=False)
    out = {}
    for v in list(m.graph.input) + list(m.graph.output):
        dims = []
        for d in v.type.tensor_type.shape.dim:
            dims.append(d.dim_param if d.dim_param else int(d.dim_value))
        out[v.name] = dims
    return out


# --------------------------------------------------------------------------------------------
# Engines

def _trt():
    ok, why = available()
    if not ok:
        raise BackendUnavailable(why)
    import tensorrt as trt

    return trt


_LOGGER = None


def _logger(trt):
    global _LOGGER
    if _LOGGER is None:
        _LOGGER = trt.Logger(trt.Logger.WARNING)
    return _LOGGER


def build_engine(onnx_path: str | os.PathLike, *, item_shapes: Mapping[str, tuple],
                 batch: tuple[int, int, int], fp16: bool = False, workspace: int = 2 << 30,
                 opt_level: int | None = None) -> bytes:
    """Serialized engine for an ONNX file with a dynamic batch axis: one profile where
    input `name` ranges over (min, opt, max) batch x `item_shapes[name]`."""
    trt = _trt()
    logger = _logger(trt)
    builder = trt.Builder(logger)
    flags = 0
    if int(trt.__version__.split(".")[0]) < 10:  # TensorRT 10 has explicit batch only; 8.x needs the flag
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    with open(onnx_path, "rb") as f:
        if not parser.parse(f.read()):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise BackendError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    if opt_level is not None:
        config.builder_optimization_level = opt_level
    lo, opt, hi = batch
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        inp = network.get_input(i)
        item = tuple(item_shapes[inp.name])
        profile.set_shape(inp.name, (lo, *item), (opt, *item), (hi, *item))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BackendError(f"TensorRT failed to build an engine from {onnx_path} (see its log above)")
    return bytes(plan)


def _gpu_identity(device: int) -> tuple[str, tuple[int, int]]:
    import torch

    p = torch.cuda.get_device_properties(device)
    return p.name, (p.major, p.minor)


def load_or_build(model: Any, *, device: int = 0, max_batch: int = 8, opt_batch: int | None = None,
                  fp16: bool = False, directory: Path | None = None, opt_level: int | None = None,
                  example: Mapping[str, np.ndarray] | None = None) -> tuple[bytes, dict]:
    """(serialized engine, info) for `model`, from the disk cache or freshly built.

    `example`: one item per input (no batch axis) fixing the item shapes the engine is
    built for; default: the model's example inputs."""
    trt = _trt()
    import torch

    items = {k: np.asarray(v) for k, v in example.items()} if example is not None else _example_items(model)
    batch2 = {k: numpy_to_torch(np.ascontiguousarray(np.stack([v, v]))).to(f"cuda:{device}") for k, v in items.items()}
    sig = [(k, items[k].dtype.str, tuple(v.shape)) for k, v in items.items()]
    opt = opt_batch or max(1, max_batch // 2)
    gpu, cc = _gpu_identity(device)
    net = getattr(model, "net", model)
    key = engine_key(model=model.name, weights=weights_digest(net), gpu_name=gpu, compute_capability=cc,
                     trt_version=trt.__version__, inputs=sig, profile=(1, opt, max_batch), fp16=fp16)
    path = _engine_path(model.name, key, directory)
    info = {"path": str(path), "key": key, "gpu": gpu, "cc": cc, "trt": trt.__version__,
            "profile": [1, opt, max_batch], "fp16": fp16, "cached": False}
    if path.exists():
        plan = path.read_bytes()
        if plan:
            info["cached"] = True
            return plan, info
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zinf-onnx-") as tmp:
        onnx_path = os.path.join(tmp, "model.onnx")
        with torch.cuda.device(device):
            names_in, names_out = export_onnx(model, onnx_path, example=batch2)
            plan = build_engine(onnx_path, item_shapes={k: s for k, _, s in sig}, batch=(1, opt, max_batch),
                                fp16=fp16, opt_level=opt_level)
    info["build_s"] = time.perf_counter() - t0
    fd, tmp_path = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(plan)
    os.replace(tmp_path, path)  # atomic: a concurrent reader sees no engine or all of it
    meta = dict(info, inputs=[[n, d, list(s)] for n, d, s in sig], outputs=names_out, inputs_order=names_in)
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    return plan, info


_TORCH_OF_TRT = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8", "INT32": "int32",
                 "INT64": "int64", "BOOL": "bool", "UINT8": "uint8"}


class TensorRTEngine:
    """A deserialized engine and one execution context (one stream at a time)."""

    def __init__(self, plan: bytes, device: int = 0):
        trt = _trt()
        import torch

        self._torch = torch
        self.device = device
        with torch.cuda.device(device):
            self._runtime = trt.Runtime(_logger(trt))
            self.engine = self._runtime.deserialize_cuda_engine(plan)
            if self.engine is None:
                raise BackendError("TensorRT could not deserialize the engine (another TensorRT or GPU?)")
            self.context = self.engine.create_execution_context()
        self.inputs, self.outputs, self.dtypes = [], [], {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            dt = self.engine.get_tensor_dtype(name)
            self.dtypes[name] = getattr(torch, _TORCH_OF_TRT[dt.name])
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                self.inputs.append(name)
            else:
                self.outputs.append(name)

    def run(self, inputs: Mapping[str, Any], stream=None) -> dict[str, Any]:
        """Enqueue one inference on `stream` (default: current); returns output tensors that
        are valid once the stream reaches this point.  Output names lose their export
        suffix (``image__out`` -> ``image``)."""
        torch = self._torch
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        ctx = self.context
        keep = []
        for name in self.inputs:
            t = inputs[name]
            if t.dtype != self.dtypes[name]:
                t = t.to(self.dtypes[name])
            t = t.contiguous()
            keep.append(t)
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        out = {}
        for name in self.outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            o = torch.empty(shape, dtype=self.dtypes[name], device=f"cuda:{self.device}")
            ctx.set_tensor_address(name, o.data_ptr())
            out[name[:-5] if name.endswith("__out") else name] = o
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise BackendError("TensorRT execute_async_v3 failed (see its log)")
        for t in keep:
            if t.device.type == "cuda":
                t.record_stream(stream)
        return out


class TrtBackend(TorchBackend):
    """The worker backend: numpy (or shared-memory) batches in, numpy out, like TorchBackend,
    with the model's forward replaced by a TensorRT engine for the input signature it was
    built for.  Other signatures run the torch model (logged once)."""

    kind = "tensorrt"

    def __init__(self, model, device: str = "cuda:0", *, max_batch: int = 8, fp16: bool = False,
                 cache: Path | None = None, opt_level: int | None = None,
                 example: Mapping[str, np.ndarray] | None = None, **_ignored):
        ok, why = available()
        if not ok:
            raise BackendUnavailable(why)
        super().__init__(model, device)
        if not self._cuda:
            raise BackendUnavailable("the TensorRT backend needs a CUDA device")
        index = self._tdevice.index or 0
        plan, self.info = load_or_build(model, device=index, max_batch=max_batch, fp16=fp16,
                                        directory=cache, opt_level=opt_level, example=example)
        self.engine = TensorRTEngine(plan, index)
        self.max_batch = max_batch
        ex = example if example is not None else _example_items(model)
        self._signature = {k: (np.asarray(v).dtype.str, tuple(np.asarray(v).shape)) for k, v in ex.items()}
        self._warned = False

    def _fits(self, batch: Mapping[str, Any]) -> bool:
        if set(batch) != set(self._signature):
            return False
        for k, t in batch.items():
            _, item = self._signature[k]
            if tuple(t.shape[1:]) != item or not 1 <= t.shape[0] <= self.max_batch:
                return False
        return True

    def _call(self, model, batch):
        if not self._fits(batch):
            if not self._warned:
                self._warned = True
                log.warning("TensorRT engine of %s was built for %s; running %s with torch",
                            model.name, self._signature, {k: tuple(v.shape) for k, v in batch.items()})
            return super()._call(model, batch)
        return self.engine.run(batch)
