"""CUDA helpers for the worker: pinned shared memory, copy/compute overlap, CUDA graphs,
GPU memory pressure, keep-warm.

Everything imports on a machine without CUDA.  The decisions - which graph bucket a batch
uses, when a graph is captured, how far to shrink batches under memory pressure, when an
idle worker runs a warm-up - are plain Python with injectable numbers and clocks, and are
unit-tested on the CPU.  Only the calls that touch a device need CUDA; they raise
`shm.cuda.CudaUnavailable` (the same typed error as the IPC plane) when it is missing.

How the worker uses them on CUDA (see docs/gpu.md for the full picture):

- `HostRegistry.ensure(segment, buffer)` once per client segment (and for the worker's own
  output ring): ``cudaHostRegister`` turns the shared pages into pinned memory, so
  ``tensor.to(device, non_blocking=True)`` is an async DMA straight from the client's memory
  and the D2H of outputs lands straight in the output ring - no staging copy on either side.
- `CopyComputeOverlap`: uploads of batch n+1 run on a copy stream while batch n computes on
  the compute stream; downloads run on a third stream, so both copy engines and the SMs
  work at once.  Only the reply path waits for the host, on one event.
- `GraphCache`: after a few eager runs of a (batch bucket, input signature), the model's
  forward is captured as a CUDA graph and replayed with static input/output buffers; a batch
  is padded up to its bucket.
- `MemoryWatch`: cudaMemGetInfo below a threshold halves the batch cap; far below it, the
  cap drops to one and new work is shed with `GpuMemoryPressure` (a typed error).
- `KeepWarm`: while the worker is idle, one small batch (a unit) every `period` seconds
  without work, as long as the busy fraction of the recent window is at most `util`, so
  clocks, caches and the allocator are warm when traffic returns (on by default on CUDA).
"""
from __future__ import annotations

import logging
import mmap
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import numpy as np

from shm.cuda import CudaUnavailable, require_cuda, runtime_api
from shm.cuda.views import on_stream

log = logging.getLogger("gpu_worker.cuda")

__all__ = [
    "CudaUnavailable", "HostRegisterError", "HostRegistration", "HostRegistry", "register_host",
    "buffer_span", "CopyComputeOverlap", "default_buckets", "bucket_for", "input_signature", "GraphCache",
    "GpuMemoryPressure", "MemoryWatch", "KeepWarm", "keep_warm_period", "KEEP_WARM_AUTO_PERIOD",
    "KEEP_WARM_MAX_UNIT",
]

# cudaHostRegister flags (cuda_runtime_api.h).
HOST_REGISTER_PORTABLE = 0x01   # pinned for every context, not just the current device's
HOST_REGISTER_READ_ONLY = 0x08  # the device only reads it; needed for PROT_READ mappings (CUDA >= 11.1)


# --------------------------------------------------------------------------------------------
# Pinned shared memory

class HostRegisterError(RuntimeError):
    """cudaHostRegister refused a buffer; the worker falls back to pageable copies."""

    def __init__(self, message: str, code: int = -1):
        super().__init__(message)
        self.code = code


def buffer_span(buf: Any) -> tuple[int, int, bool]:
    """(address, size, read-only) of a buffer: an mmap, memoryview, ndarray, or an
    (address, size) pair.  Works for read-only mappings, which ctypes cannot take."""
    if isinstance(buf, tuple) and len(buf) == 2:
        return int(buf[0]), int(buf[1]), False
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("only contiguous buffers can be registered")
        return buf.__array_interface__["data"][0], buf.nbytes, not buf.flags.writeable
    mv = memoryview(buf)
    arr = np.frombuffer(mv, np.uint8) if mv.nbytes else np.empty(0, np.uint8)
    return arr.__array_interface__["data"][0], mv.nbytes, mv.readonly


def _cuda_error(api, err: int) -> str:
    try:
        return str(api.error_string(err))
    except Exception:
        return f"cudaError {err}"


class HostRegistration:
    """One registered range; `unregister()` before the memory is unmapped."""

    __slots__ = ("addr", "size", "flags", "_api", "active")

    def __init__(self, addr: int, size: int, flags: int, api: Any):
        self.addr, self.size, self.flags = addr, size, flags
        self._api = api
        self.active = True

    def unregister(self) -> None:
        if not self.active:
            return
        self.active = False
        err = int(self._api.host_unregister(self.addr))
        if err:
            log.warning("cudaHostUnregister(%#x) failed: %s", self.addr, _cuda_error(self._api, err))


def register_host(buf: Any, *, readonly: bool | None = None, portable: bool = True) -> HostRegistration:
    """Pin `buf` (a shared-memory mapping) for async DMA: ``cudaHostRegister``, through the
    process's one CUDA runtime (`shm.cuda.runtime_api`).

    The range must start on a page (segment mappings do).  Read-only mappings need the
    read-only flag, otherwise the driver tries to pin them writable and fails."""
    addr, size, ro = buffer_span(buf)
    if readonly is None:
        readonly = ro
    if size == 0:
        raise HostRegisterError("cannot register an empty buffer")
    if addr % mmap.PAGESIZE:
        raise HostRegisterError(f"address {addr:#x} is not page-aligned; register whole mappings")
    # A mapping always covers whole pages, so rounding the length up stays inside it.
    size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    api = runtime_api()
    flags = (HOST_REGISTER_PORTABLE if portable else 0) | (HOST_REGISTER_READ_ONLY if readonly else 0)
    err = int(api.host_register(addr, size, flags))
    if err:
        raise HostRegisterError(f"cudaHostRegister({addr:#x}, {size}, flags={flags:#x}) failed: "
                                f"{_cuda_error(api, err)}", err)
    return HostRegistration(addr, size, flags, api)


class HostRegistry:
    """Registrations by name (a segment), made once each; failures are remembered so a
    segment the driver refuses costs one attempt, not one per request."""

    def __init__(self, register: Callable[..., Any] = register_host):
        self._register = register
        self._regs: dict[str, Any] = {}
        self._failed: dict[str, str] = {}

    def ensure(self, name: str, buf: Any, *, readonly: bool | None = None) -> bool:
        """True when `name` is (now) pinned."""
        if name in self._regs:
            return True
        if name in self._failed:
            return False
        try:
            self._regs[name] = self._register(buf, readonly=readonly)
            return True
        except (HostRegisterError, CudaUnavailable, ValueError) as e:
            self._failed[name] = str(e)
            log.warning("pinning %s failed, copies from it will be staged by the driver: %s", name, e)
            return False

    def drop(self, name: str) -> None:
        """Unregister `name`: call before its mapping is closed."""
        self._failed.pop(name, None)
        reg = self._regs.pop(name, None)
        if reg is not None:
            reg.unregister()

    def __contains__(self, name: str) -> bool:
        return name in self._regs

    def failures(self) -> dict[str, str]:
        return dict(self._failed)

    def close(self) -> None:
        for name in list(self._regs):
            self.drop(name)
        self._failed.clear()


# --------------------------------------------------------------------------------------------
# Copy / compute overlap

class Staged(NamedTuple):
    tensors: dict      # name -> device tensor (allocated on the copy stream)
    ready: Any         # event: the uploads are done


class Computed(NamedTuple):
    outputs: dict
    done: Any          # event: compute is done (inputs no longer read)


class CopyComputeOverlap:
    """Three streams and events, so H2D of batch n+1, compute of batch n and D2H of batch
    n-1 overlap.  Every call only enqueues; the host waits on nothing but the event it asks
    for (`Computed.done` or a download's event), and only on the reply path."""

    def __init__(self, device: int | str = 0):
        torch = require_cuda()
        self._torch = torch
        self.device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        self.copy_stream = torch.cuda.Stream(self.device)
        self.compute_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)

    def upload(self, host: Mapping[str, Any]) -> Staged:
        """Enqueue H2D of pinned (or registered) host tensors on the copy stream."""
        torch = self._torch
        with on_stream(torch, self.copy_stream):
            dev = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        return Staged(dev, ev)

    def compute(self, staged: Staged, fn: Callable[[dict], dict]) -> Computed:
        """Run `fn` on the compute stream after the upload's event (a GPU-side wait)."""
        torch = self._torch
        self.compute_stream.wait_event(staged.ready)
        with on_stream(torch, self.compute_stream):
            for t in staged.tensors.values():
                # Allocated on the copy stream, read here: without this the caching
                # allocator could hand the memory out again while compute still reads it.
                t.record_stream(self.compute_stream)
            out = fn(staged.tensors)
            ev = torch.cuda.Event()
            ev.record(self.compute_stream)
        return Computed(out, ev)

    def download(self, computed: Computed, into: Mapping[str, Any] | None = None) -> tuple[dict, Any]:
        """Enqueue D2H of the outputs on the d2h stream (into pinned buffers, e.g. slots of
        the registered output ring, when given); returns (host tensors, event)."""
        torch = self._torch
        self.d2h_stream.wait_event(computed.done)
        host = {}
        with on_stream(torch, self.d2h_stream):
            for k, v in computed.outputs.items():
                v.record_stream(self.d2h_stream)
                if into is not None and k in into:
                    host[k] = into[k].copy_(v, non_blocking=True)
                else:
                    host[k] = v.to("cpu", non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.d2h_stream)
        return host, ev


# --------------------------------------------------------------------------------------------
# CUDA graphs per batch-size bucket

def default_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to max_batch, and max_batch itself: at most ~2x padding waste, and
    log2(max_batch) graphs to hold in memory."""
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return tuple(out)


def bucket_for(n: int, buckets: Iterable[int]) -> int | None:
    """The smallest bucket that holds `n` items, or None when none does (run eagerly)."""
    best = None
    for b in buckets:
        if b >= n and (best is None or b < best):
            best = b
    return best


def input_signature(inputs: Mapping[str, Any]) -> tuple:
    """What a graph is specialised on besides the batch size: names, dtypes, item shapes,
    devices."""
    return tuple(sorted((k, str(v.dtype), tuple(v.shape[1:]), str(getattr(v, "device", "cpu")))
                        for k, v in inputs.items()))


class _Graph:
    __slots__ = ("static_in", "static_out", "replay")

    def __init__(self, static_in, static_out, replay):
        self.static_in, self.static_out, self.replay = static_in, static_out, replay


def _cuda_capture(fn: Callable[[dict], dict], static_in: dict) -> tuple[Callable[[], None], dict]:
    torch = require_cuda()
    # One more run on a side stream right before capture, as torch's docs advise: lazy
    # initialisation (cuDNN/cuBLAS handles, autotuning) must not happen inside the capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with on_stream(torch, side):
        fn(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(static_in)
    return g.replay, out


class GraphCache:
    """Run `fn` (dict of batched device tensors -> dict of batched tensors) through CUDA
    graphs, one per (bucket, input signature), captured after `warmup` eager runs.

    A batch of n is copied into the first n rows of the bucket's static inputs (the rest
    keep whatever the last batch left: every shipped model is per-item, so padded rows only
    cost compute), the graph is replayed, and the first n rows of the static outputs are
    returned.  Those are views of the graph's buffers: read or copy them (on the same
    stream) before the next replay of that bucket.  A capture that fails (a model that
    syncs with the host, control flow on values) marks that key eager for good.

    `capture(fn, static_inputs) -> (replay, static_outputs)` is injectable, so the logic is
    tested on the CPU with torch CPU tensors.
    """

    def __init__(self, fn: Callable[[dict], dict], *, buckets: Iterable[int], warmup: int = 2,
                 max_graphs: int = 16, capture: Callable | None = None):
        self.fn = fn
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError("buckets must be positive batch sizes")
        self.warmup = max(0, int(warmup))
        self.max_graphs = max(1, int(max_graphs))
        self._capture = capture or _cuda_capture
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: dict[tuple, int] = {}
        self._eager_only: dict[tuple, str] = {}
        self.stats = {"eager": 0, "warmup": 0, "captured": 0, "replayed": 0, "failed": 0, "evicted": 0}

    def plan(self, n: int, signature: tuple) -> tuple[str, int | None]:
        """('eager' | 'warmup' | 'capture' | 'replay', bucket): what `run` will do."""
        bucket = bucket_for(n, self.buckets)
        if bucket is None:
            return "eager", None
        key = (bucket, signature)
        if key in self._eager_only:
            return "eager", bucket
        if key in self._graphs:
            return "replay", bucket
        if self._seen.get(key, 0) < self.warmup:
            return "warmup", bucket
        return "capture", bucket

    def run(self, inputs: Mapping[str, Any]) -> dict:
        sizes = {int(v.shape[0]) for v in inputs.values()}
        if len(sizes) != 1:
            raise ValueError(f"inputs disagree on the batch size: {sorted(sizes)}")
        n = sizes.pop()
        sig = input_signature(inputs)
        action, bucket = self.plan(n, sig)
        key = (bucket, sig)
        if action in ("eager", "warmup"):
            if action == "warmup":
                self._seen[key] = self._seen.get(key, 0) + 1
                self.stats["warmup"] += 1
            else:
                self.stats["eager"] += 1
            return self.fn(dict(inputs))
        if action == "capture":
            g = self._capture_key(key, inputs, bucket)
            if g is None:
                self.stats["eager"] += 1
                return self.fn(dict(inputs))
        else:
            g = self._graphs[key]
            self._graphs.move_to_end(key)
        for k, v in inputs.items():
            g.static_in[k][:n].copy_(v, non_blocking=True)
        g.replay()
        self.stats["replayed"] += 1
        return {k: v[:n] for k, v in g.static_out.items()}

    def _capture_key(self, key: tuple, inputs: Mapping[str, Any], bucket: int) -> _Graph | None:
        import torch

        static_in = {}
        for k, v in inputs.items():
            buf = torch.zeros((bucket, *v.shape[1:]), dtype=v.dtype, device=v.device)
            buf[: v.shape[0]].copy_(v)
            static_in[k] = buf
        try:
            replay, static_out = self._capture(self.fn, static_in)
        except Exception as e:
            self._eager_only[key] = f"{type(e).__name__}: {e}"
            self.stats["failed"] += 1
            log.warning("CUDA graph capture failed for batch bucket %d; running eagerly: %s", bucket, e)
            return None
        g = _Graph(static_in, dict(static_out), replay)
        self._graphs[key] = g
        self.stats["captured"] += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats["evicted"] += 1
        return g

    def failures(self) -> dict:
        return dict(self._eager_only)

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._seen.clear()


# --------------------------------------------------------------------------------------------
# GPU memory pressure

class GpuMemoryPressure(RuntimeError):
    """The GPU is short of memory: this request is shed.  Retry later or elsewhere.

    Carries the protocol's 429 (QUEUE_FULL, "back off or shed load")."""

    code = 429


#: the latest of `MemoryWatch`'s cap changes it keeps (``events``)
MEMORY_EVENTS_KEPT = 64


class MemoryWatch:
    """Batch cap from free device memory, with hysteresis.

    - free < threshold: halve the cap (not below 1) - smaller batches need less activation
      memory;
    - free < threshold * shed_below: cap 1 at once, and shed new work;
    - free >= threshold * resume_above: double the cap back (up to max_batch), stop shedding;
    - in between: hold, so the cap does not flap around the threshold.

    threshold = max(min_free_bytes, min_free_fraction * total).  cudaMemGetInfo is read at
    most every `interval` seconds; `mem_info` and `clock` are injectable for tests.
    """

    def __init__(self, max_batch: int, *, min_free_bytes: int = 0, min_free_fraction: float = 0.05,
                 shed_below: float = 0.5, resume_above: float = 1.5, interval: float = 0.05,
                 device: int = 0, mem_info: Callable[[], tuple[int, int]] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if not 0 < shed_below <= 1 <= resume_above:
            raise ValueError("need 0 < shed_below <= 1 <= resume_above")
        self.max_batch = int(max_batch)
        self.cap = int(max_batch)
        self.min_free_bytes = int(min_free_bytes)
        self.min_free_fraction = float(min_free_fraction)
        self.shed_below = shed_below
        self.resume_above = resume_above
        self.interval = interval
        self._mem_info = mem_info or self._torch_mem_info(device)
        self._clock = clock
        self._next = float("-inf")
        self.shedding = False
        self.free = self.total = None
        # (what, free, cap) of the latest changes, for logs and tests: the last
        # MEMORY_EVENTS_KEPT only (a list of every one grew for the worker's life: a device
        # whose free memory swings across the thresholds, as another process's cache
        # grows and shrinks, adds one at each reading that crosses one: up to 20 a second,
        # readings being `interval` apart; the long-uptime hunt)
        self.events: deque[tuple[str, int, int]] = deque(maxlen=MEMORY_EVENTS_KEPT)

    @staticmethod
    def _torch_mem_info(device: int):
        def info():
            torch = require_cuda()
            return torch.cuda.mem_get_info(device)

        return info

    def threshold(self, total: int) -> int:
        return max(self.min_free_bytes, int(self.min_free_fraction * total))

    def observe(self, free: int, total: int) -> None:
        """Update the cap from one reading (pure: no clock, no device)."""
        self.free, self.total = free, total
        t = self.threshold(total)
        if free < t * self.shed_below:
            # Critical: even one more large batch may run out; take single items and shed
            # new work until memory comes back.
            if self.cap != 1:
                self.cap = 1
                self.events.append(("shrink", free, self.cap))
            if not self.shedding:
                self.shedding = True
                self.events.append(("shed", free, self.cap))
        elif free < t:
            if self.cap > 1:
                self.cap = max(1, self.cap // 2)
                self.events.append(("shrink", free, self.cap))
        elif free >= t * self.resume_above:
            if self.shedding:
                self.shedding = False
                self.events.append(("resume", free, self.cap))
            if self.cap < self.max_batch:
                self.cap = min(self.max_batch, self.cap * 2)
                self.events.append(("grow", free, self.cap))

    def refresh(self, force: bool = False) -> None:
        now = self._clock()
        if force or now >= self._next:
            self._next = now + self.interval
            free, total = self._mem_info()
            self.observe(int(free), int(total))

    def limit(self) -> int:
        """The largest batch to form now."""
        self.refresh()
        return self.cap

    def admit(self, n: int = 1) -> int:
        """How many of `n` items to take now; GpuMemoryPressure when shedding."""
        self.refresh()
        if self.shedding:
            free = "?" if self.free is None else f"{self.free >> 20} MiB"
            raise GpuMemoryPressure(
                f"GPU memory pressure: {free} free, below the shedding threshold of "
                f"{int(self.threshold(self.total or 0) * self.shed_below) >> 20} MiB; "
                "request shed - retry later or on another worker")
        return min(n, self.cap)

    def on_oom(self) -> None:
        """A batch hit torch.cuda.OutOfMemoryError: halve now, re-read on the next call."""
        self.cap = max(1, self.cap // 2)
        self.events.append(("oom", -1, self.cap))
        self._next = float("-inf")


# Keep-warm lives in gpu_worker.keepwarm (a CPU worker may use it without this module);
# re-exported here, where it used to be.
from gpu_worker.keepwarm import (  # noqa: E402,F401
    KEEP_WARM_AUTO_PERIOD, KEEP_WARM_MAX_UNIT, KEEP_WARM_SLOW_UNITS, KeepWarm, keep_warm_period,
)
