"""A simulated CUDA device: a `shm.cuda.CudaRuntime` that runs on the CPU.

"Device memory" is host memory, an IPC memory handle carries its address, events complete
when the test says so (`auto_done`, or `done` on one event), and tensors are CPU tensors
over the same bytes.  Everything else - state tables in /dev/shm, descriptors through
broker.protocol, validation, leases, the deferred release, reclaim, closing pools whose
owner went away - is the real code, given this object as ``runtime=``.

Needs torch (CPU build is enough): import it after ``pytest.importorskip("torch")``.
"""
from __future__ import annotations

import ctypes
import weakref

import numpy as np
import pytest
import torch

from shm.cuda import views


class FakeEvent:
    """torch.cuda.Event as the pools use it.  `sim` (the owning FakeCudaRuntime) is set on a
    subclass per runtime, so two simulations never share events."""

    sim: "FakeCudaRuntime"

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.records = 0
        self.done = self.sim.auto_done
        self.interprocess = interprocess
        self.sim.events[id(self)] = self

    def record(self, stream=None):
        self.records += 1
        self.stream = stream
        self.done = self.sim.auto_done

    def ipc_handle(self):
        return id(self).to_bytes(8, "little").ljust(64, b"\0")

    @classmethod
    def from_ipc_handle(cls, device, handle):
        return cls.sim.events[int.from_bytes(bytes(handle)[:8], "little")]

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class FakeStream:
    def __init__(self):
        self.waited = []

    def wait_event(self, ev):
        self.waited.append(ev)


class FakeCuda:
    """torch.cuda: one device, one stream."""

    def __init__(self, event_cls):
        self.Event = event_cls
        self.stream = FakeStream()

    def current_stream(self, device=None):
        return self.stream

    def current_device(self):
        return 0

    def device_count(self):
        return 1

    def get_device_properties(self, i):
        raise RuntimeError("no properties in the simulation")


class FakeTorch:
    """The torch module as the pools see it: the fake torch.cuda, the real torch.device."""

    device = torch.device

    def __init__(self, cuda: FakeCuda):
        self.cuda = cuda


class FakeDeviceMemory:
    """The runtime API: device memory = host buffers; a handle carries the address."""

    def __init__(self):
        self.blocks: dict[int, ctypes.Array] = {}
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.freed: list[int] = []

    def malloc(self, n, device):
        buf = (ctypes.c_uint8 * n)()
        addr = ctypes.addressof(buf)
        self.blocks[addr] = buf
        return addr

    def free(self, ptr, device):
        self.freed.append(ptr)

    def ipc_get_mem_handle(self, ptr, device):
        return ptr.to_bytes(8, "little").ljust(64, b"\x07")

    def ipc_open_mem_handle(self, handle, device):
        ptr = int.from_bytes(bytes(handle)[:8], "little")
        self.opened.append(ptr)
        return ptr

    def ipc_close_mem_handle(self, ptr, device):
        self.closed.append(ptr)


class _Holder:
    __slots__ = ("__array_interface__", "keep", "__weakref__")


class FakeCudaRuntime:
    """The `CudaRuntime` of the simulation.  Attributes for the tests: `cuda` (its stream
    records every wait), `memory` (opened/closed/freed addresses), `events` (every event
    made, by id) and `auto_done` (whether a newly recorded event has completed)."""

    def __init__(self):
        self.events: dict[int, FakeEvent] = {}
        self.auto_done = True
        self.Event = type("Event", (FakeEvent,), {"sim": self})
        self.cuda = FakeCuda(self.Event)
        self.memory = FakeDeviceMemory()
        self._torch = FakeTorch(self.cuda)

    # ------------------------------------------------------------------ CudaRuntime
    def torch(self):
        return self._torch

    def api(self):
        return self.memory

    def tensor_at(self, ptr, shape, dt, device, keep, on_drop=None, args=()):
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if n == 0:
            return torch.empty(shape, dtype=views.torch_dtype(dt)), None
        h = _Holder()
        h.__array_interface__ = {"shape": tuple(shape), "typestr": dt.str, "data": (ptr, False), "version": 3}
        h.keep = keep
        fin = weakref.finalize(h, on_drop, *args) if on_drop is not None else None
        # numpy keeps the holder as the array's base, torch keeps the array: the finalizer
        # runs when the last tensor view is gone, as with __cuda_array_interface__ on a device.
        return torch.from_numpy(np.asarray(h)), fin

    def on_device(self, t, device):
        d = getattr(t, "device", None)
        return d is not None and d.type == "cpu"


@pytest.fixture
def sim():
    """A fresh simulated device per test."""
    return FakeCudaRuntime()
