"""Backends: run a Model on a device for a list of per-request input dicts.

A backend owns the data movement around a model call, and tries hard not to copy:

* stacking: one request is passed as ``arr[np.newaxis]``, a view of the request's own
  array (in the worker: the client's shared-memory slot).  Several requests are copied once
  with ``np.stack(..., out=)`` into a staging buffer that is kept and reused for the next
  batch of the same shape (pinned host memory on CUDA, so the upload can be asynchronous).
  A staging buffer that a model's output aliases (``echo``) is handed over to that output
  and not reused, so a result can never be overwritten by a later batch.
* numpy -> torch on the CPU is zero-copy.  Shared-memory inputs are read-only numpy
  arrays, and torch has no read-only tensors: ``torch.from_numpy`` would warn on every new
  process and flipping the array's ``writeable`` flag would hand out a writable alias of
  memory the worker must not write.  ``torch.from_dlpack`` is the sanctioned route: numpy
  >= 2.1 exports read-only arrays through DLPack 1.0 with the read-only flag set, torch
  accepts it without a warning and without a copy.  The model is trusted not to write to
  its inputs (none of the shipped ones do; under ``torch.inference_mode`` in-place ops on
  inputs are a programming error anyway), and the worker maps client segments read-only,
  so a rogue write faults instead of corrupting a client's data.  Only on an older numpy
  (no read-only DLPack export) does the backend fall back to ``torch.from_numpy`` with
  that one warning filtered - still no copy.
* outputs come back as one numpy array per output name for the whole batch (one
  device->host copy per name on CUDA); each request gets ``batch_output[i]``, a read-only
  view, never a per-item copy.

Request ``meta`` (the header's free-form map, ``client.infer(..., meta={...})``) reaches a
model only if it asks for it, by declaring a keyword parameter named ``meta`` (on a Model's
``__call__``, a wrapped callable, or a wrapped ``nn.Module``'s ``forward``).  It is detected
once, when the backend is made (`takes_meta`); a model that does not declare it is called
exactly as before and the worker does no per-request work for it.  A batchable model gets
``meta`` as a list of the requests' dicts in batch order (``meta[i]`` belongs to
``batch[name][i]``, a list of one for a batch of one); a model with ``batchable = False``
and a streaming model, which are always run one request at a time, get that request's dict.

Backends are not thread-safe: one worker thread drives one backend.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from shm.cuda.views import on_stream

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "CallableBackend",
    "TorchBackend",
    "declares_meta",
    "make_backend",
    "numpy_to_torch",
    "warmup",
]

Inputs = Mapping[str, np.ndarray]
Outputs = dict[str, np.ndarray]

TENSORRT_MISSING = ("TensorRT is not installed; pip install '.[gpu]' on a machine with an NVIDIA GPU "
                    "(and a CUDA build of torch), or use the torch backend")


class BackendError(RuntimeError):
    """A batch could not be run: incompatible requests or malformed model outputs."""


class BadOutputs(BackendError):
    """What the model returned is not a dict of outputs with the batch's leading axis: the
    model's mistake, which the same request meets again (its client is not told that
    retrying may help)."""


def _outputs(model, out: Any) -> Mapping[str, Any]:
    """``out``, which the model returned, if it is a mapping of outputs (a list or a bare
    array failed as an AttributeError from deep in a backend)."""
    if not isinstance(out, Mapping):
        raise BadOutputs(f"model {model.name!r} returned {type(out).__name__}; expected a dict of outputs "
                         "(name -> array)")
    return out


class UnsupportedInput(BackendError):
    """A request's input the backend's framework cannot hold (a dtype torch lacks): the
    request's fault, answered INVALID_INPUT, not the model's."""


class BackendUnavailable(RuntimeError):
    """The backend cannot be used on this machine (a library or the hardware is missing)."""


# --------------------------------------------------------------------------- conversions


def numpy_to_torch(arr: np.ndarray):
    """A CPU tensor sharing ``arr``'s memory, also for read-only arrays, without a warning.

    Raises UnsupportedInput for dtypes torch cannot represent (object, strings, ...).
    """
    import torch

    t = None
    if arr.flags.writeable:
        try:
            t = torch.from_numpy(arr)
        except (TypeError, ValueError):
            pass  # e.g. negative strides or a non-native byte order: handled below
    else:
        try:
            t = torch.from_dlpack(arr)
        except (BufferError, TypeError, ValueError, RuntimeError):
            # numpy < 2.1 refuses to export read-only arrays over DLPack.  from_numpy still
            # shares memory; its warning is about exactly the case we accept on purpose.
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                    t = torch.from_numpy(arr)
            except (TypeError, ValueError):
                pass
    if t is not None:
        if not t.data_ptr() % t.element_size():
            return t
        # torch takes its items to be aligned to their size, numpy does not: an inline
        # input starts wherever its frame lies in libzmq's receive buffer (or a link
        # datagram), and a complex128 one 8 bytes off a 16-byte boundary crashed the worker
        # in torch's kernels (SIGSEGV; the broker retried it on the next worker, which
        # crashed too: the fidelity hunt).  A copy is aligned (0.15 us to ask).
    elif arr.dtype.hasobject or arr.dtype.kind in "USVO":
        raise UnsupportedInput(f"input dtype {arr.dtype} has no torch equivalent")
    # Layouts torch cannot alias (negative strides, byte-swapped data, misaligned items): a
    # copy is the only option, and it is the request's problem, not a hot path.
    try:
        return torch.from_numpy(np.array(arr, dtype=arr.dtype.newbyteorder("="), order="C", copy=True))
    except TypeError as e:
        raise UnsupportedInput(f"input dtype {arr.dtype} has no torch equivalent") from e


def _to_numpy(value, name: str) -> np.ndarray:
    if type(value) is np.ndarray:
        return value
    if isinstance(value, np.ndarray):
        # A subclass (np.matrix, a masked array, a recarray) as its plain array: np.matrix
        # stays 2-d when indexed, so a request's output of an (n, 3) matrix came out (1, 3)
        # instead of (3,) (found by the edge hunt).
        return np.asarray(value)
    if type(value).__module__.startswith("torch"):
        value = value.detach()  # CPU tensors only here: CUDA outputs were fetched first
        # A lazily conjugated or negated view (t.conj(), some math on complex tensors): numpy
        # cannot take it as it is, so its bits are applied first (it failed as the model's
        # own error, "retrying may help": found by the data hunt).
        if value.is_conj():
            value = value.resolve_conj()
        if value.is_neg():
            value = value.resolve_neg()
        if getattr(value, "layout", None) is not None and str(value.layout) != "torch.strided":
            # (sparse, or another layout: numpy takes dense tensors only; the dtype was blamed)
            raise BadOutputs(f"output {name!r} is a {str(value.layout).removeprefix('torch.')} torch tensor: "
                               f"numpy takes dense ones; convert it in the model (e.g. .to_dense())")
        try:
            return value.numpy()
        except TypeError as e:  # a dtype numpy lacks (bfloat16): the model must say which it means
            raise BadOutputs(f"output {name!r} is a torch {str(value.dtype).removeprefix('torch.')} tensor, which "
                               f"has no numpy dtype: convert it in the model (e.g. .float())") from e
    arr = np.asarray(value)
    if arr.dtype.hasobject:
        raise BadOutputs(f"output {name!r} is a {type(value).__name__}, not an array or tensor")
    return arr


# --------------------------------------------------------------------------- staging buffers


class _Staging:
    """Reusable batch buffers, one per (input name, dtype, per-item shape), LRU-bounded."""

    def __init__(self, allocate, max_entries: int = 16):
        self._allocate = allocate
        self._max = max_entries
        self._buffers: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def get(self, name: str, dtype: np.dtype, shape: tuple, n: int) -> tuple[tuple, np.ndarray]:
        key = (name, dtype.str, shape)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < n:
            cap = n if buf is None else max(n, buf.shape[0])
            buf = self._allocate((cap, *shape), dtype)
            self._buffers[key] = buf
            while len(self._buffers) > self._max:
                self._buffers.popitem(last=False)
        self._buffers.move_to_end(key)
        return key, buf[:n]

    def forget(self, key: tuple) -> None:
        self._buffers.pop(key, None)

    def clear(self) -> None:
        self._buffers.clear()


def _framework(model) -> str:
    return getattr(model, "framework", "torch")


def _signature(inputs: Inputs) -> tuple:
    return tuple(sorted((k, v.dtype.str, v.shape) for k, v in inputs.items()))


# --------------------------------------------------------------------------- request meta


def declares_meta(fn) -> bool:
    """Whether ``fn`` declares a parameter named ``meta`` that can be passed by keyword
    (``**kwargs`` alone does not count: only a model that asks for it gets it)."""
    try:
        param = inspect.signature(fn).parameters.get("meta")
    except (TypeError, ValueError):  # builtins and C callables without a signature
        return False
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                inspect.Parameter.KEYWORD_ONLY)


def _meta_caller(model):
    """``call(batch, meta) -> outputs`` for a model that declares ``meta``, else None.

    Looked for, in order: the Model's own ``__call__``; the function a `CallableModel`
    wraps; the ``forward`` of the module a `TorchModuleModel` wraps (called the way the
    wrapper calls it: the inputs as keyword arguments, or the whole dict when they do not
    bind, plus ``meta=``).  Run once per backend, never per call."""
    if declares_meta(model):  # inspect.signature of an instance is its __call__'s
        return lambda batch, meta: model(batch, meta=meta)
    from gpu_worker import models as M  # lazy: models imports torch-free, but keep import order loose

    if isinstance(model, M.CallableModel) and declares_meta(model.fn):
        fn = model.fn

        def call_fn(batch, meta):
            out = fn(batch, meta=meta)
            if model.streaming:
                return M.stream_outputs(out, model.name)
            return M.normalise_outputs(out, model.name)
        return call_fn
    module = getattr(model, "module", None)
    if isinstance(model, M.TorchModuleModel) and module is not None and declares_meta(module.forward):
        sig = inspect.signature(module.forward)
        styles: dict[tuple, str] = {}

        def call_module(batch, meta):
            # As `TorchModuleModel` calls it without meta: by name, else one tensor
            # positionally whatever its name (it went as a dict, which forward(x) took for
            # x), else the dict; the memo bounded as there (names are the client's choice).
            names = tuple(sorted(batch))
            style = styles.get(names)
            if style is None:
                try:
                    sig.bind(**dict.fromkeys(names), meta=None)
                    style = "kwargs"
                except TypeError:
                    style = "dict"
                    try:
                        sig.bind(None, meta=None)
                        if len(names) == 1 and not M.wants_mapping(sig):
                            style = "positional"
                    except TypeError:
                        pass
                if len(styles) >= M.MAX_CALL_STYLES:
                    styles.clear()
                styles[names] = style
            if style == "kwargs":
                out = module(**batch, meta=meta)
            elif style == "positional":
                (tensor,) = batch.values()
                out = module(tensor, meta=meta)
            else:
                out = module(dict(batch), meta=meta)
            if model.streaming:
                return M.stream_outputs(out, model.name)
            return M.normalise_outputs(out, model.name)
        return call_module
    return None


# --------------------------------------------------------------------------- backends


class Backend:
    """Runs one model on one device.  Subclasses convert to and from the model's arrays."""

    kind = "base"

    def __init__(self, model, device: str = "cpu"):
        self.model = model
        self.device = device
        self._staging = _Staging(self._allocate)
        #: call(batch, meta) for a model that declares ``meta`` (see the module docstring)
        self._meta_call = _meta_caller(model)
        #: whether run()/run_stream()/run_device() pass request meta on to the model; when
        #: False, callers need not collect it (the worker's data planes don't)
        self.takes_meta = self._meta_call is not None

    # Hooks ------------------------------------------------------------------------------
    def _allocate(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def _to_model(self, model, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        if _framework(model) != "numpy":
            raise BackendError(f"model {model.name!r} is a {_framework(model)} model; "
                               f"the {self.kind} backend passes numpy arrays (use make_backend)")
        return batch

    def _from_model(self, outputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return {k: _to_numpy(v, k) for k, v in outputs.items()}

    def _call(self, model, batch):
        return model(batch)

    def _call_meta(self, model, batch, meta):
        # Only for a model that declares meta (self.takes_meta); subclasses that override
        # _call (TensorRT) keep their two-argument hook.
        return self._meta_call(batch, meta)

    def _invoke(self, model, batch, meta):
        return self._call(model, batch) if meta is None else self._call_meta(model, batch, meta)

    def _iterate(self, partials: Iterator):
        return partials

    # API --------------------------------------------------------------------------------
    def run(self, requests: Sequence[Inputs], meta: Sequence[Mapping[str, Any]] | None = None) -> list[Outputs]:
        """One output dict per request, in order.  Requests must be stack-compatible (same
        names, dtypes and shapes); a model with ``batchable = False`` is run once per
        request.  ``meta``: one dict per request (its header's ``meta``), passed on only if
        the model declares it (`takes_meta`; missing: empty dicts), else ignored."""
        model = self.model
        if getattr(model, "streaming", False):
            raise BackendError(f"model {model.name!r} streams its outputs; use run_stream()")
        if not requests:
            return []
        if self._meta_call is None:  # the hot path: exactly as without meta support
            if len(requests) > 1 and not getattr(model, "batchable", True):
                return [self._run_batch(model, [r])[0] for r in requests]
            return self._run_batch(model, requests)
        metas = self._metas(meta, len(requests))
        if not getattr(model, "batchable", True):
            return [self._run_batch(model, [r], m)[0] for r, m in zip(requests, metas)]
        return self._run_batch(model, requests, metas)

    def _metas(self, meta, n: int) -> list | None:
        """The per-request meta list for a model that takes it, else None (no work)."""
        if self._meta_call is None:
            return None
        if meta is None:
            return [{} for _ in range(n)]
        metas = [{} if m is None else m for m in meta]
        if len(metas) != n:
            raise BackendError(f"{len(metas)} meta dicts for {n} requests")
        return metas

    def run_stream(self, request: Inputs, meta: Mapping[str, Any] | None = None) -> Iterator[Outputs]:
        """Partial outputs of one request, in the order the model yields them (a model that
        does not stream yields its one output).  ``meta``: the request's dict, passed on
        only if the model declares it."""
        model = self.model
        batch, _ = self._stack([request])
        m = None if self._meta_call is None else ({} if meta is None else meta)
        partials = self._invoke(model, self._to_model(model, batch), m)
        if isinstance(partials, Mapping):  # a non-streaming model: a single "partial"
            partials = iter((partials,))
        for out in self._iterate(partials):
            yield self._split(model, self._from_model(_outputs(model, out)), 1)[0]

    def close(self) -> None:
        self._staging.clear()

    # Internals --------------------------------------------------------------------------
    def _run_batch(self, model, requests: Sequence[Inputs], meta=None) -> list[Outputs]:
        # meta: None (the model does not take it), a list (batchable) or one dict.
        n = len(requests)
        if n == 1:
            # A lone request: a view with a new leading axis, no copy of its (shared)
            # memory, nothing staged.  reshape, not arr[None] or expand_dims: indexing gives
            # the new axis a 0 stride, which sends torch's channels_last kernels down a path
            # 2-3x slower, and expand_dims is this reshape behind three Python calls.
            batch = {}
            for k, v in requests[0].items():
                if type(v) is not np.ndarray:
                    v = np.asarray(v)
                batch[k] = v.reshape((1, *v.shape))
            outputs = self._from_model(_outputs(model, self._call(model, self._to_model(model, batch)) if meta is None
                                                else self._call_meta(model, self._to_model(model, batch), meta)))
            return self._split(model, outputs, 1)
        batch, staged = self._stack(requests)
        outputs = self._from_model(_outputs(model, self._call(model, self._to_model(model, batch)) if meta is None
                                            else self._call_meta(model, self._to_model(model, batch), meta)))
        if staged:
            # An output that aliases a staging buffer owns it from now on.
            for key, buf in staged:
                if any(np.may_share_memory(o, buf) for o in outputs.values()):
                    self._staging.forget(key)
        return self._split(model, outputs, n)

    def _stack(self, requests: Sequence[Inputs]) -> tuple[dict[str, np.ndarray], list]:
        first = requests[0]
        if len(requests) == 1:
            # A view with a new leading axis: no copy of the request's (shared) memory.
            # expand_dims, not arr[None]: indexing gives the new axis a 0 stride, which
            # sends torch's channels_last kernels down a path 2-3x slower.
            # (expand_dims is this reshape behind three Python calls.)
            out = {}
            for k, v in first.items():
                v = np.asarray(v)
                out[k] = v.reshape((1, *v.shape))
            return out, []
        sig = _signature(first)
        for i, r in enumerate(requests[1:], 1):
            if _signature(r) != sig:
                raise BackendError(f"request {i} is not stack-compatible with request 0: "
                                   f"{_signature(r)} != {sig}")
        n = len(requests)
        batch, staged = {}, []
        for name, arr in first.items():
            key, buf = self._staging.get(name, arr.dtype, arr.shape, n)
            np.stack([r[name] for r in requests], out=buf)
            batch[name] = buf
            staged.append((key, buf))
        return batch, staged

    @staticmethod
    def _split(model, outputs: dict[str, np.ndarray], n: int) -> list[Outputs]:
        if n == 1:  # a lone request (the common case of a latency-bound service): one pass
            one: Outputs = {}
            for name, arr in outputs.items():
                if arr.ndim == 0 or arr.shape[0] != 1:
                    raise BadOutputs(f"model {model.name!r} output {name!r} has shape {arr.shape}; "
                                       f"expected a leading batch axis of 1")
                view = arr[0, ...]
                if isinstance(view, np.ndarray):
                    view.flags.writeable = False
                one[name] = view
            return [one]
        for name, arr in outputs.items():
            if arr.ndim == 0 or arr.shape[0] != n:
                raise BadOutputs(f"model {model.name!r} output {name!r} has shape {arr.shape}; "
                                   f"expected a leading batch axis of {n}")
        per_request: list[Outputs] = [{} for _ in range(n)]
        for name, arr in outputs.items():
            for i in range(n):
                view = arr[i, ...]  # a 0-d view, not a scalar copy, for per-request scalars
                if isinstance(view, np.ndarray):
                    # Read-only: these views may alias inputs in shared memory (echo).
                    view.flags.writeable = False
                per_request[i][name] = view
        return per_request


class CallableBackend(Backend):
    """numpy in, numpy out: for ``framework = "numpy"`` models.  Never imports torch."""

    kind = "numpy"

    def __init__(self, model, device: str = "cpu"):
        if _framework(model) != "numpy":
            raise BackendError(f"model {model.name!r} is a {_framework(model)} model; "
                               "the numpy backend can only run numpy models (use make_backend)")
        super().__init__(model, device)


class TorchBackend(Backend):
    """torch models on "cpu" or "cuda:N", under ``torch.inference_mode()``."""

    kind = "torch"

    def __init__(self, model, device: str = "cpu"):
        import torch

        from .devices import resolve_device

        self._torch = torch
        device = resolve_device(device)
        self._cuda = device.startswith("cuda")
        self._tdevice = torch.device(device)
        super().__init__(model, device)

    def _allocate(self, shape, dtype):
        if self._cuda:
            # Pinned host memory: the host->device copy of a staged batch can run async.
            t = self._torch.empty(shape, dtype=numpy_to_torch(np.empty(0, dtype)).dtype, pin_memory=True)
            return t.numpy()
        return np.empty(shape, dtype)

    def _to_model(self, model, batch):
        if _framework(model) == "numpy":
            return batch  # numpy models (echo, chunks) run here too, untouched
        tensors = {k: numpy_to_torch(v) for k, v in batch.items()}
        if self._cuda:
            # Safe to be asynchronous: _from_model synchronises before run() returns, so a
            # staging buffer is never refilled while its upload is still in flight.
            tensors = {k: t.to(self._tdevice, non_blocking=True) for k, t in tensors.items()}
        return tensors

    def _from_model(self, outputs):
        torch = self._torch
        fetched = {}
        for k, v in outputs.items():
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                v = v.to("cpu", non_blocking=True)
            fetched[k] = v
        if self._cuda:
            torch.cuda.current_stream(self._tdevice).synchronize()
        return {k: _to_numpy(v, k) for k, v in fetched.items()}

    def _call(self, model, batch):
        with self._torch.inference_mode():
            return model(batch)

    def _call_meta(self, model, batch, meta):
        with self._torch.inference_mode():
            return self._meta_call(batch, meta)

    def run_device(self, requests: Sequence[Mapping[str, Any]], stream=None,
                   meta: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Like run(), but outputs stay torch tensors on the model's device and nothing
        synchronises: the caller orders its reads on `stream` (the stream everything is
        queued on; default the current one).  Inputs may be numpy arrays or torch tensors
        (CUDA IPC views).  ``meta`` as for run().  For the GPU worker's CUDA transport;
        torch models only."""
        torch = self._torch
        model = self.model
        if getattr(model, "streaming", False):
            raise BackendError(f"model {model.name!r} streams its outputs; use run_stream()")
        if _framework(model) != "torch":
            raise BackendError(f"run_device runs torch models; {model.name!r} is a {_framework(model)} model")
        if not requests:
            return []
        metas = self._metas(meta, len(requests))
        batchable = getattr(model, "batchable", True)
        if len(requests) > 1 and not batchable:
            if metas is None:
                return [self.run_device([r], stream)[0] for r in requests]
            return [self.run_device([r], stream, [m])[0] for r, m in zip(requests, metas)]
        if metas is not None and not batchable:
            metas = metas[0]  # an unbatched model gets its one request's dict
        ctx = on_stream(torch, stream) if (stream is not None and self._cuda) else contextlib.nullcontext()
        n = len(requests)
        out = {}
        with ctx:
            batch = {}
            for name in requests[0]:
                parts = [self._device_tensor(r[name]) for r in requests]
                batch[name] = parts[0].unsqueeze(0) if n == 1 else torch.stack(parts)
            outputs = self._invoke(model, batch, metas)
            for k, v in outputs.items():
                # Inside `ctx` (the worker stream): an output that is not a tensor is uploaded
                # here, and outside it took memory from the default stream's pool of torch's
                # caching allocator, then read on the worker stream with no record_stream (the
                # allocator could hand that memory out again while the stream still read it;
                # found by reading; untested on a GPU).
                t = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v), device=self._tdevice)
                if t.dim() == 0 or t.shape[0] != n:
                    raise BackendError(f"model {model.name!r} output {k!r} has shape {tuple(t.shape)}; "
                                       f"expected a leading batch axis of {n}")
                out[k] = t
        return [{k: t[i] for k, t in out.items()} for i in range(n)]

    def _device_tensor(self, x):
        torch = self._torch
        if not isinstance(x, torch.Tensor):
            x = numpy_to_torch(np.asarray(x))
        return x.to(self._tdevice, non_blocking=True) if x.device != self._tdevice else x

    def _iterate(self, partials):
        # Enter inference mode around each step rather than across yields, so the caller's
        # own code between partials never runs in inference mode.
        it = iter(partials)
        while True:
            with self._torch.inference_mode():
                try:
                    out = next(it)
                except StopIteration:
                    return
            yield out


# Backend kinds make_backend knows ("tensorrt" is gpu_worker.trt.TrtBackend, imported on use).
_BACKENDS = {"torch": TorchBackend, "numpy": CallableBackend}
_KINDS = (*_BACKENDS, "tensorrt")


def make_backend(model, device: str = "cpu", kind: str = "auto", **options) -> Backend:
    """The backend for ``model``: ``kind="auto"`` follows ``model.framework``.

    ``kind="tensorrt"`` is `gpu_worker.trt.TrtBackend` when `trt.available()` says so, else
    BackendUnavailable with the reason; ``options`` (max_batch, fp16, ...) go to it."""
    if kind == "auto":
        kind = _framework(model)
    if kind not in _KINDS:
        raise BackendError(f"unknown backend {kind!r}; expected one of {', '.join(_KINDS)} or 'auto'")
    if kind == "tensorrt":
        from gpu_worker import trt

        ok, why = trt.available()
        if not ok:
            # A missing tensorrt is what most users meet: say how to get it, or what else to use.
            raise BackendUnavailable(TENSORRT_MISSING if importlib.util.find_spec("tensorrt") is None
                                     else f"the TensorRT backend cannot run here: {why}")
        return trt.TrtBackend(model, device, **options)
    return _BACKENDS[kind](model, device)


def warmup(backend: Backend, model=None, batch_sizes: Iterable[int] = (1,)) -> dict[int, float]:
    """Run the model's example inputs at each batch size; returns seconds per size.

    ``model`` defaults to (and must be) the backend's model; it is accepted so that call
    sites read as "warm up this model on this backend".

    The first calls pay for lazy initialisation (allocator, kernel selection, CUDA context
    and autotuning); doing them before taking traffic keeps them out of the latency tail.
    A model without example inputs is skipped (empty result).
    """
    if model is None:
        model = backend.model
    elif model is not backend.model:
        raise BackendError(f"warmup: backend runs {backend.model.name!r}, not {model.name!r}")
    try:
        example = model.example_inputs()
    except NotImplementedError:
        return {}
    sizes = sorted({max(1, int(b)) for b in batch_sizes})
    if not getattr(model, "batchable", True):
        sizes = [1]
    # The example inputs as they were: a batch of one is passed as views of them, as a
    # worker passes a client's shared-memory slots, so a model that writes to its inputs
    # changes them here, where it costs nothing to say so.
    before = {k: np.array(v, copy=True) for k, v in example.items()
              if type(v) is np.ndarray and not v.dtype.hasobject} if isinstance(example, Mapping) else {}
    timings: dict[int, float] = {}
    for b in sizes:
        t0 = time.perf_counter()
        if getattr(model, "streaming", False):
            for _ in backend.run_stream(example):
                pass
        else:
            backend.run([example] * b)
        timings[b] = time.perf_counter() - t0
        if before:
            for k, was in before.items():
                if was.tobytes() != example[k].tobytes():
                    raise WritesInputs(
                        f"model {model.name!r} wrote to its input {k!r} (its example's values changed as it ran): "
                        f"a worker's inputs are its clients' shared memory, mapped read-only, and torch cannot "
                        f"enforce that: an in-place write there (x.add_(), x += 1, ReLU(inplace=True) on the "
                        f"input) crashes the worker (SIGSEGV), and every worker the request is retried on; copy "
                        f"it first (x = x.clone(), or np.array(x))")
            before = {}  # (a batch of more is a staging copy: no client's memory)
    return timings


class WritesInputs(BackendError):
    """A model wrote to its inputs during its warm-up (`warmup`)."""
