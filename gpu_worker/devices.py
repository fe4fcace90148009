"""Device names for the worker: one place that turns ``--device`` into "cpu" or "cuda:N".

torch is imported inside the functions, so a torch-less install can still import this module
(and run the numpy-only models on "cpu").
"""
from __future__ import annotations

import re

__all__ = ["DeviceError", "DeviceUnavailable", "cuda_available", "cuda_device_count", "resolve_device"]

_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


class DeviceError(ValueError):
    """A device spec that is not one of 'auto', 'cpu', 'cuda' or 'cuda:N'."""


class DeviceUnavailable(RuntimeError):
    """The device spec is well formed but this machine cannot provide it."""


def _torch():
    try:
        import torch
    except Exception:  # ImportError, or a broken install that fails while importing
        return None
    return torch


#: device nodes one of which a machine whose GPU torch could use has: NVIDIA's driver
#: (its control node, or /proc/driver/nvidia where containers hide the node), Jetson's
#: integrated GPU (nvhost, nvmap), WSL2's GPU paravirtualisation, AMD's ROCm (a HIP build
#: of torch answers torch.cuda)
_GPU_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/nvhost-ctrl-gpu", "/dev/nvmap", "/dev/dxg",
              "/dev/kfd")


def _no_gpu_here() -> bool:
    """True when this machine has no GPU device node at all: no torch build could see a
    device, so "auto" is "cpu" without importing torch (a second or two of a worker's
    start, and some 170,000 objects, for a model that does not use it)."""
    import os
    import sys

    return "torch" not in sys.modules and not any(os.path.exists(p) for p in _GPU_NODES)


def cuda_available() -> bool:
    """True when torch is importable and sees at least one CUDA device; never raises."""
    torch = _torch()
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a driver/runtime mismatch raises from deep inside torch.cuda
        return False


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 without torch or CUDA); never raises."""
    if not cuda_available():
        return 0
    try:
        return int(_torch().cuda.device_count())
    except Exception:
        return 0


def _why_no_cuda() -> str:
    torch = _torch()
    if torch is None:
        return "torch is not installed (pip install '.[torch]')"
    if getattr(torch.version, "cuda", None) is None:
        return (f"this torch build ({torch.__version__}) is CPU-only; install a CUDA build of torch "
                "on a machine with an NVIDIA GPU")
    return "torch has CUDA support but sees no GPU (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)"


def resolve_device(spec: str | None) -> str:
    """Normalise a device spec.

    None, "" and "auto" pick "cuda:0" when CUDA is usable and "cpu" otherwise (without
    importing torch on a machine with no GPU device node: `_no_gpu_here`); "cuda" means
    "cuda:0".  Asking for CUDA explicitly on a machine without it raises DeviceUnavailable
    rather than silently falling back, because a benchmark that quietly ran on the CPU is
    worse than one that did not run.
    """
    s = "auto" if spec is None else str(spec).strip().lower()
    if s in ("", "auto"):
        return "cpu" if _no_gpu_here() or not cuda_available() else "cuda:0"
    if s == "cpu":
        return "cpu"
    m = _CUDA_RE.match(s)
    if m is None:
        raise DeviceError(f"unknown device {spec!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
    index = int(m.group(1) or 0)
    if not cuda_available():
        raise DeviceUnavailable(f"device {spec!r} requested but CUDA is not available: {_why_no_cuda()}")
    count = cuda_device_count()
    if index >= count:
        raise DeviceUnavailable(f"device {spec!r} requested but only {count} CUDA device(s) are visible")
    return f"cuda:{index}"
