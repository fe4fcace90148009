"""The CUDA data plane: a `HostPlane` plus device memory (docs/gpu.md, sections 3 and 7).

Constructed only when the worker's device is ``cuda:N`` (`CudaPlane.open`), so the CPU path
imports and pays nothing for it.  Same methods as `gpu_worker.planes.HostPlane`; host
tensors (shared memory, inline frames) are mapped by the host plane it wraps, and outputs
that do not stay on the device are written by it.

Invariants a maintainer must keep:

* One worker stream orders everything: IPC event waits, uploads, compute, output copies and
  hand-off events are queued on it, and the host never waits on the request path - except
  where a client is about to be told FINAL while the device may still read its inputs (host
  outputs: one synchronise before FINAL; an error FINAL of a job with CUDA inputs:
  `finish_reads`).  The client frees its input slots at FINAL.
* CUDA IPC inputs are honoured from a client on this host only; a numpy model gets a host
  copy of them (ordered after the producer's event).
* Outputs stay on the device (a slot of our `CudaPool`, handed off to the client's pid) when
  the request says ``reply="cuda"``, or ``"auto"`` and it had CUDA inputs, and the client is
  on this host.  A full device pool degrades to host memory, never to an error.
* Client segments and the output ring are pinned (`HostRegistry`) so uploads and downloads
  are DMA; a segment is unpinned before its mapping goes (`SegmentCache.on_forget`).
* `close()` synchronises, closes the IPC cache, unpins, then closes the pools (pins first:
  they must go while the pages they pin are still mapped).
* The worker's device is current on every thread that does device work (`_bind_thread`):
  the loop's (when the plane is made) and the compute thread's (at its first batch).
* A CUDA error that leaves the context unusable (an illegal memory access, a device-side
  assert: every later call fails the same way) ends the worker (`_check_context`,
  `CUDA_CONTEXT_LOST_EXIT`), so that it is restarted and its requests run elsewhere; an
  out-of-memory error and a model's own exceptions are failures of their batch only.
* Only public names of `shm.cuda` and `gpu_worker.cuda_runtime` are used here.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import numpy as np

from broker import protocol as P
from gpu_worker.compute import message_of, raised
from gpu_worker.cuda_runtime import GpuMemoryPressure, HostRegistry, MemoryWatch
from gpu_worker.job import Job
from gpu_worker.planes import HostPlane, check_outputs, check_owner
from shm.cuda.views import on_stream

#: client segments up to this size are pinned (cudaHostRegister) for DMA uploads...
PIN_MAX_BYTES = 4 << 30
#: ...and at most this much of them at once (64 cached segments could be 256 GiB otherwise)
PIN_BUDGET_BYTES = 8 << 30

#: The worker's exit status when its CUDA context is lost (`lost_context`): a crash to the
#: launcher, which restarts it (EX_SOFTWARE).
CUDA_CONTEXT_LOST_EXIT = 70

__all__ = ["CudaPlane", "CUDA_CONTEXT_LOST_EXIT", "lost_context"]

log = logging.getLogger("gpu_worker")


def lost_context(e: BaseException) -> None:
    """End the worker now: its CUDA context is unusable (``e`` says why).  Logged first,
    and the log handlers flushed (the process ends with `os._exit`: from the compute thread
    too, and past the worker's handlers of a model's errors)."""
    try:
        log.critical("CUDA context lost (%s): this worker cannot run anything on its device any more; exiting "
                     "with status %d so that it is restarted (its requests are retried by the broker)",
                     raised(e), CUDA_CONTEXT_LOST_EXIT)
        for h in (*log.handlers, *logging.getLogger().handlers):
            h.flush()
        sys.stderr.flush()
    except BaseException:  # nothing may keep it from exiting
        pass
    os._exit(CUDA_CONTEXT_LOST_EXIT)


class CudaPlane:
    """Device-side transport around a `HostPlane` (see the module docstring).

    ``torch`` is the torch module (a stand-in in CPU tests), ``stream`` the worker stream,
    ``pool`` a `shm.cuda.CudaPool` for outputs, ``cache`` a `shm.cuda.CudaPoolCache` for
    inputs, ``pins`` a `gpu_worker.cuda_runtime.HostRegistry`, ``mem`` a
    `gpu_worker.cuda_runtime.MemoryWatch`; ``device_path``: the backend runs torch models on
    device tensors (`run_device`), so CUDA inputs need no host copy."""

    def __init__(self, host: HostPlane, *, torch, stream, pool, cache, pins, mem, device_path: bool,
                 device_index: int = 0):
        self.host = host
        self.backend = host.backend
        self.holders = host.holders
        self.torch = torch
        self.stream = stream
        self.pool = pool
        self.cache = cache
        self.pins = pins
        self.mem = mem
        self.device_path = device_path
        self.device_index = device_index
        #: what ends the worker when its CUDA context is lost (`_check_context`)
        self.lost_context = lost_context
        self._bound = threading.local()  # .device: set on a thread whose current device is ours
        self._bind_thread()  # the loop's thread (it makes the plane)
        self._np_dtypes: dict[Any, np.dtype] = {}
        self.transports = host.transports if "cuda" in host.transports else (*host.transports, "cuda")
        # Unpin a client segment before its mapping goes (LRU, sweep, close).
        self._pinned: dict[str, int] = {}  # client segment -> bytes pinned (PIN_BUDGET_BYTES in all)
        host.inputs.on_forget = self._unpin
        if host.out_pool is not None:
            pins.ensure(host.out_pool.name, host.out_pool.mapping)

    @classmethod
    def open(cls, host: HostPlane, model, *, device: str, max_batch: int, pool_capacity: int = 256 << 20,
             pool_slots: int = 1024) -> "CudaPlane":
        """The plane of a worker on ``device`` (``cuda:N``) running ``model`` on ``host.backend``."""
        import torch

        from shm.cuda import CudaPool, CudaPoolCache

        tdevice = torch.device(device)
        index = tdevice.index or 0
        # Our device current before anything touches the driver: shm.cuda's runtime switches
        # to a pool's device around each call and back to the thread's previous one with a
        # raw cudaSetDevice, and that was device 0 (never set): a worker on cuda:N (N > 0)
        # made a context on GPU 0 (hundreds of MiB) at the pool's cudaMalloc and at each IPC
        # open (found by reading; untested on a GPU with several devices).
        torch.cuda.set_device(index)
        # One stream for IPC waits, compute, output copies and hand-off events: the GPU
        # orders them, the host never waits on the request path.
        stream = torch.cuda.Stream(device=tdevice)
        pool = CudaPool(pool_capacity, device=index, slots=pool_slots)
        cache = CudaPoolCache(local={pool.name: pool})
        device_path = getattr(model, "framework", "torch") == "torch" and hasattr(host.backend, "run_device")
        return cls(host, torch=torch, stream=stream, pool=pool, cache=cache, pins=HostRegistry(),
                   mem=MemoryWatch(max_batch, device=index), device_path=device_path, device_index=index)

    def _bind_thread(self) -> None:
        """Make the worker's device current on this thread, once per thread (see `open`): the
        current device is per thread, and the compute thread's was device 0."""
        if not getattr(self._bound, "device", False):
            self.torch.cuda.set_device(self.device_index)
            self._bound.device = True

    def _check_context(self, e: BaseException) -> None:
        """End the worker (`lost_context`) if ``e`` is a CUDA error after which its context is
        unusable; return otherwise (the caller re-raises ``e``).

        An illegal memory access or a device-side assert is sticky: every later CUDA call
        fails the same way.  The worker went on heartbeating and answered every request 500
        (after `_isolate` ran each again in halves): a black hole its service's broker kept
        routing to (found by reading; untested on a GPU).  torch reports CUDA errors as
        `torch.AcceleratorError` (a RuntimeError with the ``error_code``; its message starts
        "CUDA error: "; older torch raised a plain RuntimeError with that message), and
        shm.cuda's runtime as "cudaX failed: CUDA error N (...)".  Such an error is fatal only
        when the context really is gone: one more synchronise of the worker stream fails too.
        A non-sticky one (an invalid launch configuration from one input's shape) leaves it
        usable, and must fail its request, not the worker (the broker would run that input
        again on another worker, and another).  Out of memory is the batch's (the cap
        halves), and a model's own exceptions are never CUDA errors."""
        torch = self.torch
        if isinstance(e, torch.cuda.OutOfMemoryError):
            return
        accel = getattr(torch, "AcceleratorError", None)
        if not ((accel is not None and isinstance(e, accel))
                or (isinstance(e, RuntimeError) and "CUDA error" in message_of(e))):
            return
        try:
            self.stream.synchronize()
        except Exception:
            self.lost_context(e)

    def _unpin(self, segment: str) -> None:
        """The input cache's on_forget hook: unpin before the mapping goes.

        The hook runs on the loop's thread (LRU, the housekeeping sweep of dead owners)
        while a batch may be running on the offload thread, its non-blocking uploads from
        these very pages still queued on the stream: those must be done before the pages
        are unregistered (a DMA from memory no longer pinned is undefined)."""
        if self._pinned.pop(segment, None) is not None:
            try:
                self.stream.synchronize()
            except Exception as e:
                self._check_context(e)
                log.exception("could not synchronise the worker stream before unpinning %s", segment)
        self.pins.drop(segment)

    def admit(self) -> str | None:
        try:
            self.mem.admit()
        except GpuMemoryPressure as e:
            return str(e)
        return None

    # ------------------------------------------------------------------ inputs

    def map_inputs(self, job: Job, frames) -> None:
        req = job.req
        host = self.host
        inputs: dict[str, Any] = {}
        refs: dict[str, P.TensorRef] = {}
        for t in req.tensors:
            dt = P.parse_dtype(t.dtype)
            loc = t.loc
            if type(loc) is P.CudaLoc:
                arr = self._map_device(req, t, dt)
                job.cuda_in = True
            else:
                arr = host.map_tensor(req, t, dt, frames)
                if type(loc) is P.ShmLoc and loc.segment not in self.pins:
                    # Pinned, so the upload is a DMA straight from the client's slot.  Pinning
                    # faults in the whole mapping, so a segment larger than PIN_MAX_BYTES
                    # (a client's sparse 64 GiB pool would pin 64 GiB) is read unpinned.
                    m = host.inputs.mapping(loc.segment)
                    if (m is not None and len(m) <= PIN_MAX_BYTES
                            and sum(self._pinned.values()) + len(m) <= PIN_BUDGET_BYTES):
                        if self.pins.ensure(loc.segment, m, readonly=True):
                            self._pinned[loc.segment] = len(m)  # a refused pin holds no budget
            inputs[t.name] = arr
            refs[t.name] = t
        job.inputs, job.refs = inputs, refs

    def _map_device(self, req: P.Request, t: P.TensorRef, dt: np.dtype):
        if req.host != self.host.host:
            raise P.ProtocolError("CUDA IPC reference from another host")
        check_owner(req, t.loc.pool)  # the pool's state table is a segment of its owner
        arr = self.cache.view(t.loc, dt, tuple(t.shape), stream=self.stream)
        if not self.device_path:
            # A numpy model reads host memory: one copy, ordered after the producer.
            try:
                with on_stream(self.torch, self.stream):
                    host = arr.to("cpu", non_blocking=True)
                self.stream.synchronize()
            except Exception as e:
                self._check_context(e)
                raise
            arr = host.numpy()
            arr.flags.writeable = False
        return arr

    # ------------------------------------------------------------------ running

    def batch_limit(self, max_batch: int) -> int:
        # Smaller batches need less activation memory; MemoryWatch halves the cap under
        # pressure and doubles it back.
        return min(max_batch, self.mem.limit())

    def run(self, jobs: list[Job]) -> list:
        self._bind_thread()  # the compute thread's first batch
        try:
            # Request meta only for a model that declares it (fixed when the backend is made).
            extra = {"meta": [j.req.meta for j in jobs]} if getattr(self.backend, "takes_meta", False) else {}
            if self.device_path and any(j.cuda_in or self._wants_device(j) for j in jobs):
                for j in jobs:
                    j.device_ran = True  # its inputs are read by work queued on the stream
                outs = self.backend.run_device([j.inputs for j in jobs], stream=self.stream, **extra)
                if not all(self._wants_device(j) for j in jobs) or self._reads_pinned(jobs):
                    # Some outputs go back through host memory, which waits for the model
                    # anyway: wait here, inside the batch's compute window (the heartbeat
                    # thread speaks for the worker meanwhile, and the batch is timed as the
                    # model's run), not later in `_to_host` on the loop's thread, where a GPU
                    # batch longer than the liveness window went without heartbeats (the
                    # worker presumed dead, its requests run again elsewhere) and was timed
                    # as its launch alone (the races hunt; untested on a GPU).
                    # Likewise when an input lies in a client segment we pinned: its upload
                    # is a DMA queued on the stream (behind earlier batches), straight from
                    # the client's slot, which the client reuses once told FINAL; a reply
                    # kept on the device was sent before that DMA ran, and the request
                    # read the client's next data (the GPU read-through).
                    self.stream.synchronize()
                return outs
            # On the worker stream too (the backend waits for it before returning): on the
            # thread's default stream, with no event between, this batch's kernels were
            # unordered with an earlier device batch's still queued there, and a model that
            # fills the same device buffer every call (a captured graph's outputs)
            # overwrote it before that batch's outputs were copied out (the GPU read-through).
            with on_stream(self.torch, self.stream):
                return self.backend.run([j.inputs for j in jobs], **extra)
        except self.torch.cuda.OutOfMemoryError:
            self.mem.on_oom()
            raise
        except Exception as e:
            self._check_context(e)
            raise

    def detach(self, outs: list) -> list:
        """The host plane's copies, queued on the worker stream: device outputs were made
        there by kernels that may still run, and their memory is the worker stream's in
        torch's caching allocator.  A copy on the thread's default stream (another stream,
        with no event between) could read them before they were written, and once an
        original was dropped, the next run's kernels could reuse its memory before the copy
        read it (`Worker._isolate`, the GPU read-through)."""
        try:
            with on_stream(self.torch, self.stream):
                return self.host.detach(outs)
        except Exception as e:
            self._check_context(e)
            raise

    def warm(self, inputs) -> None:
        """A keep-warm unit, on the worker stream: on the loop thread's default stream it was
        unordered with a device batch still queued on the worker stream (one whose replies
        stay on the device is not waited for), so a TensorRT engine's one execution context
        ran on two streams at once, and a model that fills one device buffer every call
        could overwrite that batch's outputs before they were copied into the pool (found by
        reading; untested on a GPU).  The backend waits for the stream, so a unit also waits
        for such a batch."""
        try:
            with on_stream(self.torch, self.stream):
                self.backend.run([inputs])
        except Exception as e:
            self._check_context(e)
            raise

    def _reads_pinned(self, jobs: list[Job]) -> bool:
        """Whether a job of a device batch has an input in a client segment we pinned (an
        asynchronous upload from client memory; an unpinned one is staged by the driver
        before the copy call returns, an inline frame is ours, a CUDA input is ordered by
        the reply's events)."""
        pinned = self._pinned
        if not pinned:
            return False
        for j in jobs:
            for t in j.refs.values() if j.refs else ():
                loc = t.loc
                if type(loc) is P.ShmLoc and loc.segment in pinned:
                    return True
        return False

    def _wants_device(self, job: Job) -> bool:
        req = job.req
        # Lent to the attested process only (see HostPlane.write_outputs).
        return ((req.reply == "cuda" or (req.reply == "auto" and job.cuda_in)) and req.host == self.host.host
                and req.pid is not None)

    # ------------------------------------------------------------------ outputs

    def write_outputs(self, job: Job, out: dict, checked: bool = False,
                      max_inline: int | None = None) -> tuple[list[P.TensorRef], list[Any]]:
        try:
            if self._wants_device(job):
                if not checked:
                    check_outputs(out)  # before any device slot is handed off (the host plane checks its own)
                refs = self._device_outputs(job, out)
                if refs is not None:
                    return refs, []
                # Device pool full (the client holds many results): degrade to host memory.
            if isinstance(out, dict) and any(isinstance(v, self.torch.Tensor) for v in out.values()):
                out = self._to_host(out)
        except Exception as e:
            # A device batch's kernels are not waited for: their fault shows here, at the
            # copy into the pool, the hand-off's event or the download.
            self._check_context(e)
            raise
        return self.host.write_outputs(job, out, checked, max_inline)

    def _np_dtype(self, tdtype) -> np.dtype:
        dt = self._np_dtypes.get(tdtype)
        if dt is None:
            dt = self._np_dtypes[tdtype] = self.torch.empty(0, dtype=tdtype).numpy().dtype
        return dt

    def _device_outputs(self, job: Job, out: dict) -> list[P.TensorRef] | None:
        """Outputs copied into our device pool and handed off (CudaLoc), or None when the
        pool is full (the caller then replies through host memory)."""
        torch = self.torch
        pool = self.pool
        handed = []
        refs = []
        try:
            with on_stream(self.torch, self.stream):
                for name, value in out.items():
                    src = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
                    dt = self._np_dtype(src.dtype)
                    dst = pool.try_alloc(tuple(src.shape), dt)
                    if dst is None:
                        pool.reclaim()
                        dst = pool.try_alloc(tuple(src.shape), dt)
                    if dst is None:
                        for t in handed:
                            pool.free(t)
                        return None
                    handed.append(dst)
                    dst.copy_(src, non_blocking=True)
                    loc = P.cuda_loc(pool.hand_off(dst, stream=self.stream, holder_pid=job.req.pid,
                                                   holder_start=job.req.pid_start))
                    refs.append(P.TensorRef(name=name, dtype=dt.str, shape=list(src.shape), loc=loc))
        except BaseException:
            for t in handed:
                try:
                    pool.free(t)
                except Exception:
                    pass
            raise
        return refs

    def _to_host(self, out: dict) -> dict:
        torch = self.torch
        fetched = {}
        with on_stream(self.torch, self.stream):
            for k, v in out.items():
                fetched[k] = v.to("cpu", non_blocking=True) if isinstance(v, torch.Tensor) else v
        # Host outputs are complete before FINAL, which also orders our reads of CUDA inputs
        # before the client frees them (docs/gpu.md, section 3).
        self.stream.synchronize()
        return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in fetched.items()}

    def finish_reads(self, job: Job) -> None:
        if job.cuda_in and job.device_ran:
            # The client frees its input slots at FINAL: our queued reads must be done.
            # Only a job that was part of a device run has any: mapping a CUDA input
            # queues an event wait, no read (a numpy model's host copy was waited for).
            # A job answered without running (a 429 bounce, a RECALL, a deadline, while
            # another's batch runs on the compute thread) was made to wait for that whole
            # batch here, on the loop's thread: no heartbeats, and the answer that was to
            # free the request for an idle worker came only after the batch (the GPU
            # read-through).
            try:
                self.stream.synchronize()
            except Exception as e:
                self._check_context(e)
                log.exception("could not synchronise the worker stream before an error reply")

    # ------------------------------------------------------------------ upkeep

    def housekeeping(self) -> None:
        self.host.housekeeping()
        try:
            self.cache.poll()
            self.cache.sweep()
            self.pool.reclaim()
        except Exception as e:
            self._check_context(e)  # an idle worker's lost context shows here first
            log.exception("CUDA pool housekeeping failed")

    def usage(self) -> dict:
        """The host plane's, plus the device pool and device memory (the memory watch's last
        cudaMemGetInfo reading; None until it took one)."""
        out = self.host.usage()
        try:
            used = self.pool.book.live_bytes()
        except Exception:  # a report must never take the worker down
            used = None
        out.update(cuda_used=used, cuda_capacity=getattr(self.pool, "capacity", None),
                   device_used=None if self.mem.free is None else self.mem.total - self.mem.free,
                   device_total=self.mem.total)
        return out

    def lent(self) -> int:
        self.cache.poll()
        self.pool.reclaim()
        return self.pool.in_use() + self.host.lent()

    def close(self) -> None:
        try:
            self.stream.synchronize()
        except Exception:
            pass
        self.cache.close()
        self.pins.close()   # before the mappings it pins are closed
        self.pool.close()
        self.host.close()
