"""CUDA access: whether this process can use CUDA, the one loader of the CUDA runtime, and
`CudaRuntime`, the one object through which the device pools touch CUDA.

Contract:

- Importing this module touches no device and needs neither torch nor cuda-python; what
  needs CUDA raises `CudaUnavailable` with the reason (no torch, a CPU-only torch, no GPU,
  no runtime library).
- `runtime_api()` is the only place in the project that loads the CUDA runtime library:
  the IPC plane (`CudaPool`, `CudaPoolCache`) and the worker's host registration
  (`gpu_worker.cuda_runtime.register_host`) both use it.  It initialises torch's CUDA first,
  then opens the libcudart torch loaded (found in /proc/self/maps), so its calls share
  torch's runtime state and primary context; ldconfig's and torch's wheel copies come next,
  and cuda-python's bindings only when no library loads.  Loaded once per process.
- `CudaRuntime` is the whole surface the pools use: torch, the runtime API, `tensor_at`
  and `on_device`.  `CudaPool`, `CudaPoolCache` and the SDK's `CudaSide` take one
  (``runtime=``, default `default_runtime()`), so a fake can stand in for the device
  (tests/shm/cuda_fake.py) without patching a module.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib
import os
import threading
from typing import Any, Protocol

from . import views
from .refs import HANDLE_SIZE

__all__ = [
    "CudaUnavailable", "cuda_status", "require_cuda", "runtime_api", "CudaRuntime", "TorchCuda",
    "default_runtime",
]


class CudaUnavailable(RuntimeError):
    """This process cannot use CUDA (no torch, a CPU-only torch, no GPU, no CUDA runtime)."""


def cuda_status() -> tuple[bool, str]:
    """(usable, reason): can this process use CUDA devices through torch?  Never raises."""
    try:
        import torch
    except Exception as e:  # ImportError or a broken install
        return False, f"torch is not importable ({type(e).__name__}: {e}); pip install '.[torch]'"
    if getattr(torch.version, "cuda", None) is None:
        return False, (f"this torch build ({torch.__version__}) is CPU-only: no CUDA device. Install a "
                       "CUDA build of torch on a machine with an NVIDIA GPU")
    try:
        if not torch.cuda.is_available():
            return False, ("torch has CUDA support but sees no CUDA device (check nvidia-smi, the "
                           "driver and CUDA_VISIBLE_DEVICES)")
    except Exception as e:  # driver/runtime mismatch
        return False, f"CUDA initialisation failed: {e}"
    return True, "ok"


_USABLE: Any = None  # torch, once cuda_status() said yes in this process


def require_cuda():
    """torch, when CUDA is usable; CudaUnavailable (with the reason) otherwise.

    A yes is kept for the process: the pools and views call this on every request, and
    `cuda_status` asks the driver for the device count each time (``torch.cuda.is_available``
    is not cached), which took tens of microseconds on the GPU machine."""
    global _USABLE
    if _USABLE is not None:
        return _USABLE
    ok, why = cuda_status()
    if not ok:
        raise CudaUnavailable(why)
    import torch

    _USABLE = torch
    return torch


# --------------------------------------------------------------------------------------------
# The runtime API: two bindings of the same calls

class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_SIZE)]


class _CtypesRuntime:
    """The CUDA runtime torch already loaded, through ctypes: no extra dependency, and the
    same library (so the same primary context) as torch's own calls."""

    kind = "ctypes"

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        self._lib = lib
        c_int, c_void_p, c_size_t, c_uint = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        sig = {
            "cudaGetDevice": [ctypes.POINTER(c_int)],
            "cudaSetDevice": [c_int],
            "cudaMalloc": [ctypes.POINTER(c_void_p), c_size_t],
            "cudaFree": [c_void_p],
            "cudaIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), c_void_p],
            "cudaIpcOpenMemHandle": [ctypes.POINTER(c_void_p), _IpcHandle, c_uint],
            "cudaIpcCloseMemHandle": [c_void_p],
            "cudaHostRegister": [c_void_p, c_size_t, c_uint],
            "cudaHostUnregister": [c_void_p],
        }
        for fname, args in sig.items():
            f = getattr(lib, fname)
            f.argtypes = args
            f.restype = c_int
        lib.cudaGetErrorString.argtypes = [c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p

    def error_string(self, err: int) -> str:
        msg = self._lib.cudaGetErrorString(err)
        return msg.decode() if msg else f"cudaError {err}"

    def _check(self, err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what} failed: CUDA error {err} ({self.error_string(err)})")

    def _on(self, device: int):
        runtime = self

        class _Switch:
            def __enter__(self):
                cur = ctypes.c_int(-1)
                runtime._check(runtime._lib.cudaGetDevice(ctypes.byref(cur)), "cudaGetDevice")
                self.prev = cur.value
                if self.prev != device:
                    runtime._check(runtime._lib.cudaSetDevice(device), "cudaSetDevice")

            def __exit__(self, *exc):
                if self.prev != device and self.prev >= 0:
                    runtime._lib.cudaSetDevice(self.prev)

        return _Switch()

    def malloc(self, nbytes: int, device: int) -> int:
        p = ctypes.c_void_p()
        with self._on(device):
            self._check(self._lib.cudaMalloc(ctypes.byref(p), nbytes), f"cudaMalloc({nbytes})")
        return int(p.value)

    def free(self, ptr: int, device: int) -> None:
        with self._on(device):
            self._check(self._lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def ipc_get_mem_handle(self, ptr: int, device: int) -> bytes:
        h = _IpcHandle()
        with self._on(device):
            self._check(self._lib.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), HANDLE_SIZE)

    def ipc_open_mem_handle(self, handle: bytes, device: int) -> int:
        h = _IpcHandle()
        ctypes.memmove(ctypes.addressof(h), bytes(handle), HANDLE_SIZE)
        p = ctypes.c_void_p()
        with self._on(device):
            # 1 = cudaIpcMemLazyEnablePeerAccess, the only flag the call accepts.
            self._check(self._lib.cudaIpcOpenMemHandle(ctypes.byref(p), h, 1), "cudaIpcOpenMemHandle")
        return int(p.value)

    def ipc_close_mem_handle(self, ptr: int, device: int) -> None:
        with self._on(device):
            self._check(self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")

    def host_register(self, addr: int, size: int, flags: int) -> int:
        return int(self._lib.cudaHostRegister(ctypes.c_void_p(addr), size, flags))

    def host_unregister(self, addr: int) -> int:
        return int(self._lib.cudaHostUnregister(ctypes.c_void_p(addr)))


class _CudaPythonRuntime:
    """cuda-python's runtime bindings (``cuda.bindings.runtime``, or ``cuda.cudart`` before
    12.6), used when no libcudart can be found for ctypes."""

    kind = "cuda-python"

    def __init__(self, rt):
        self._rt = rt
        self.path = getattr(rt, "__file__", "cuda-python")

    def _ok(self, res, what: str):
        err, *rest = res if isinstance(res, tuple) else (res,)
        if int(err) != 0:
            raise RuntimeError(f"{what} failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    @staticmethod
    def _code(res) -> int:
        return int(res[0] if isinstance(res, tuple) else res)

    def error_string(self, err: int) -> str:
        try:
            res = self._rt.cudaGetErrorString(self._rt.cudaError_t(err))
            msg = res[1] if isinstance(res, tuple) else res
            return msg.decode() if isinstance(msg, bytes) else str(msg)
        except Exception:
            return f"cudaError {err}"

    def _on(self, device: int):
        rt, ok = self._rt, self._ok

        class _Switch:
            def __enter__(self):
                self.prev = ok(rt.cudaGetDevice(), "cudaGetDevice")
                if self.prev != device:
                    ok(rt.cudaSetDevice(device), "cudaSetDevice")

            def __exit__(self, *exc):
                if self.prev != device:
                    rt.cudaSetDevice(self.prev)

        return _Switch()

    def malloc(self, nbytes, device):
        with self._on(device):
            return int(self._ok(self._rt.cudaMalloc(nbytes), "cudaMalloc"))

    def free(self, ptr, device):
        with self._on(device):
            self._ok(self._rt.cudaFree(ptr), "cudaFree")

    def ipc_get_mem_handle(self, ptr, device):
        with self._on(device):
            h = self._ok(self._rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
        return bytes(h.reserved)[:HANDLE_SIZE]

    def ipc_open_mem_handle(self, handle, device):
        h = self._rt.cudaIpcMemHandle_t()
        h.reserved = bytes(handle)
        with self._on(device):
            return int(self._ok(self._rt.cudaIpcOpenMemHandle(h, self._rt.cudaIpcMemLazyEnablePeerAccess),
                                "cudaIpcOpenMemHandle"))

    def ipc_close_mem_handle(self, ptr, device):
        with self._on(device):
            self._ok(self._rt.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")

    def host_register(self, addr, size, flags):
        return self._code(self._rt.cudaHostRegister(addr, size, flags))

    def host_unregister(self, addr):
        return self._code(self._rt.cudaHostUnregister(addr))


def _libcudart_candidates() -> list[str]:
    found: list[str] = []
    try:  # the copy torch loaded, whatever its file is called
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "libcudart" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:  # pragma: no cover
        pass
    name = ctypes.util.find_library("cudart")
    if name:
        found.append(name)
    try:
        import torch

        site = os.path.dirname(os.path.dirname(torch.__file__))
        found += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
        found += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*.so*")))
    except Exception:
        pass
    return found


_api: Any = None
_api_lock = threading.Lock()


def runtime_api():
    """The CUDA runtime API of this process, loaded once; CudaUnavailable without one.

    Its calls (device ordinals as torch numbers them; the first five raise RuntimeError
    with CUDA's message, the host calls return CUDA's error code, 0 for success):
    ``malloc(nbytes, device) -> ptr``, ``free(ptr, device)``,
    ``ipc_get_mem_handle(ptr, device) -> 64 bytes``, ``ipc_open_mem_handle(handle, device)
    -> ptr``, ``ipc_close_mem_handle(ptr, device)``, ``host_register(addr, size, flags)``,
    ``host_unregister(addr)``, and ``error_string(code) -> str``."""
    global _api
    with _api_lock:
        if _api is not None:
            return _api
        torch = require_cuda()
        torch.cuda.init()  # loads libcudart, so /proc/self/maps names it
        errors = []
        for path in _libcudart_candidates():
            try:
                _api = _CtypesRuntime(ctypes.CDLL(path), path)
                return _api
            except (OSError, AttributeError) as e:
                errors.append(f"{path}: {e}")
        for mod in ("cuda.bindings.runtime", "cuda.cudart"):
            try:
                _api = _CudaPythonRuntime(importlib.import_module(mod))
                return _api
            except ImportError as e:
                errors.append(f"{mod}: {e}")
        raise CudaUnavailable("no CUDA runtime library found for IPC (looked for libcudart through "
                              "/proc/self/maps, ldconfig and torch's wheels, and for cuda-python): "
                              + "; ".join(errors))


# --------------------------------------------------------------------------------------------
# The seam

class CudaRuntime(Protocol):
    """Everything the device pools ask of CUDA, as one object.

    Every method is called lazily, at the first use that needs a device (so constructing a
    `CudaPoolCache` needs none), and each may raise `CudaUnavailable`."""

    def torch(self) -> Any:
        """The torch module, CUDA usable: the pools use ``torch.cuda`` (``Event`` with
        ``interprocess=`` and ``from_ipc_handle``, ``current_stream``, ``current_device``,
        ``device_count``, ``get_device_properties``) and ``torch.device``."""

    def api(self) -> Any:
        """The runtime API: raw allocation and IPC handles (`runtime_api`'s calls)."""

    def tensor_at(self, ptr: int, shape: tuple, dt: Any, device: int, keep: Any, on_drop=None,
                  args=()) -> tuple[Any, Any]:
        """(tensor, finalizer or None) over device bytes, by `views.tensor_at`'s rules."""

    def on_device(self, t: Any, device: int) -> bool:
        """Is `t` a tensor of this runtime on `device`?"""


class TorchCuda:
    """The real `CudaRuntime`: torch's CUDA and the runtime library `runtime_api` loads."""

    def torch(self) -> Any:
        return require_cuda()

    def api(self) -> Any:
        return runtime_api()

    def tensor_at(self, ptr, shape, dt, device, keep, on_drop=None, args=()):
        return views.tensor_at(ptr, shape, dt, device, keep, on_drop, args)

    def on_device(self, t, device) -> bool:
        return views.on_device(t, device)

    def __repr__(self) -> str:
        return "<TorchCuda>"


_DEFAULT = TorchCuda()


def default_runtime() -> TorchCuda:
    """The process's real `CudaRuntime` (what ``runtime=None`` means)."""
    return _DEFAULT
