"""The worker process: one model, one MDP/0.2 worker socket, dynamic batching.

Loop (one thread, on purpose: a lone request goes from socket to model with no thread
hand-off, and the GIL makes a separate I/O thread compete with the model's Python code):

    poll(socket, until the batcher's wake-up or the next heartbeat)
    drain every delivered message: REQUEST -> inputs mapped in place -> batcher
                                   CANCEL  -> drop if still pending (499)
    if the batcher yields a batch: run it, write outputs, send FINALs
    heartbeat / broker liveness / reconnect (Paranoid Pirate)

While a batch computes, new requests wait in the socket; when it finishes they are all taken
at once, so batches grow with load and a lone request under light load is never delayed.
A batch whose compute time is unknown or predicted to exceed half a heartbeat interval runs
on a compute thread instead, so the loop keeps heartbeating and receiving while it runs (the
broker would otherwise presume a worker that computes for seconds dead, and retry its work).
Fast batches stay on the loop's thread: the hand-off costs tens of microseconds, which is
most of a small request's budget.

Inputs are read in place: shared-memory references become read-only numpy views of the
client's segment (mapped once per segment), inline frames become numpy views of the received
ZeroMQ frame.  Outputs go to this worker's output ring (reply "shm") or inline.  An output
that *is* one of the inputs (an identity model such as `echo`) is answered with the input's
own reference: nothing is copied, whatever the tensor's size, and the client keeps that slot
until it releases the result (docs/protocol.md, section 7).

SIGTERM drains: stop reading new work, finish what is held, send DISCONNECT, exit 0.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from broker import protocol as P
from broker.protocol.wire import NOBLOCK, recv_frames, send_frames
from gpu_worker.batching import Batcher, Pending

log = logging.getLogger("gpu_worker")
_POLLIN = int(zmq.POLLIN)
# Milliseconds a closed reply_to socket keeps delivering what it has queued: a FINAL already
# told to the broker as DONE must still reach its client (close() itself does not wait).
DIRECT_LINGER_MS = 2000


@dataclass
class WorkerConfig:
    broker: str
    model: str = "echo"
    service: str | None = None        # defaults to the model's name
    device: str | None = None         # None/"auto": cuda:0 when present, else cpu
    max_batch: int = 8
    max_delay: float = 0.002          # seconds a batch may wait for company (adaptive)
    max_cost: float = float("inf")
    credit: int | None = None         # requests the broker may hand us at once (default 2*max_batch)
    heartbeat_interval: float = 1.0
    heartbeat_liveness: int = 3
    out_capacity: int = 256 << 20     # output ring bytes
    out_slots: int = 4096
    warmup: bool = True
    transports: tuple[str, ...] = ("inline", "shm")
    backend: str = "auto"             # "auto" (the model's framework), "torch", "numpy", "tensorrt"
    cuda_pool_capacity: int = 256 << 20   # device pool for outputs kept on the GPU (cuda only)
    cuda_pool_slots: int = 1024
    direct_reply: bool = True         # send a same-host client's FINAL to its reply_to socket (docs/protocol.md section 8)
    direct_sockets: int = 64          # reply_to sockets kept open (least recently used closed first)
    done_delay: float = 0.005         # seconds a DONE may wait to gather more (never past a request's deadline)
    done_batch: int | None = None     # ... or until this many FINALs are pending (default credit // 4)


class _Job:
    """One request held by the worker."""

    __slots__ = ("envelope", "req", "inputs", "opaque", "received", "deadline", "refs", "input_ms", "cuda_in")

    def __init__(self, envelope, req, inputs, opaque, received, deadline, refs):
        self.envelope = envelope
        self.req = req            # P.Request or None (opaque)
        self.inputs = inputs      # dict name -> ndarray (views)
        self.opaque = opaque      # body frames of an opaque request
        self.received = received
        self.deadline = deadline
        self.refs = refs          # name -> TensorRef of the input (for identity pass-through)
        self.input_ms = 0.0       # mapping the inputs (shm views, inline frames)
        self.cuda_in = False      # some input is a CUDA IPC view (the worker stream reads it)


class Worker:
    def __init__(self, cfg: WorkerConfig, *, ctx: zmq.Context | None = None):
        from gpu_worker.backends import make_backend
        from gpu_worker.devices import resolve_device
        from gpu_worker.models import load_model
        from shm import SegmentCache, ShmPool

        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.model = load_model(cfg.model, self.device)
        self.service = cfg.service or self.model.name
        max_batch = cfg.max_batch if getattr(self.model, "batchable", False) else 1
        self.backend = make_backend(self.model, self.device, cfg.backend,
                                    **({"max_batch": max_batch} if cfg.backend == "tensorrt" else {}))
        self.batcher = Batcher(max_batch=max_batch, max_cost=cfg.max_cost, max_delay=cfg.max_delay)
        self.credit = cfg.credit or max(2 * max_batch, 2)
        self.host = P.local_host_id()
        self.pid = os.getpid()
        self.inputs_cache = SegmentCache()
        self.out_pool = ShmPool(cfg.out_capacity, slots=cfg.out_slots) if "shm" in cfg.transports else None
        self.transports = tuple(cfg.transports)
        self.ctx = ctx or zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.jobs: dict[bytes, _Job] = {}   # envelope -> job, while pending in the batcher
        self.stop = threading.Event()
        self.served = 0
        self._compute_ewma: dict[int, float] = {}  # batch size -> seconds
        self._offload: _ComputeThread | None = None
        self._busy = False
        self._service_b = self.service.encode()
        self._streaming = bool(getattr(self.model, "streaming", False))
        # Direct reply: one PUSH socket per client reply_to endpoint, LRU; envelopes of the
        # FINALs sent that way, gathered into DONEs for the broker (_note_done).
        self._direct: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._done: list[bytes] = []
        self._done_due = 0.0
        self._done_max = max(1, cfg.done_batch or self.credit // 4)
        # While a batch's replies are written: header-only FINALs per reply_to, sent as one
        # FINALS message per client when the batch is done (None: send each at once).
        self._coalesce: dict[str, list] | None = None
        self.direct_sent = 0
        self.cuda = self.device.startswith("cuda")
        self._runner = self._run_host
        if self.cuda:
            self._init_cuda()
        if cfg.warmup:
            self._warmup()

    # ------------------------------------------------------------------ CUDA

    def _init_cuda(self) -> None:
        """Device-side transport: everything here exists only on a CUDA worker, so the CPU
        path pays nothing for it (methods are swapped once, here)."""
        import torch

        from gpu_worker.cuda_runtime import GpuMemoryPressure, HostRegistry, MemoryWatch
        from shm.cuda import CudaPool, CudaPoolCache

        cfg = self.cfg
        self._torch = torch
        self._tdevice = torch.device(self.device)
        index = self._tdevice.index or 0
        # One stream for IPC waits, compute, output copies and hand-off events: the GPU
        # orders them, the host never waits on the request path.
        self.stream = torch.cuda.Stream(device=self._tdevice)
        self.cuda_pool = CudaPool(cfg.cuda_pool_capacity, device=index, slots=cfg.cuda_pool_slots)
        self.cuda_cache = CudaPoolCache(local={self.cuda_pool.name: self.cuda_pool})
        self.host_reg = HostRegistry()
        # Unpin a client segment before its mapping goes (LRU, sweep, close).
        self.inputs_cache.on_forget = self.host_reg.drop
        if self.out_pool is not None:
            self.host_reg.ensure(self.out_pool.name, self.out_pool.mapping)
        self.mem = MemoryWatch(self.batcher.max_batch, device=index)
        self._max_batch = self.batcher.max_batch
        self._device_path = getattr(self.model, "framework", "torch") == "torch" and hasattr(self.backend, "run_device")
        self._np_dtypes: dict[Any, np.dtype] = {}
        if "cuda" not in self.transports:
            self.transports = (*self.transports, "cuda")
        self._pending_cuda_in = False
        self._GpuMemoryPressure = GpuMemoryPressure
        self._map_inputs = self._map_inputs_cuda
        self._runner = self._run_cuda

    def _close_cuda(self) -> None:
        try:
            self.stream.synchronize()
        except Exception:
            pass
        self.cuda_cache.close()
        self.host_reg.close()   # before the mappings it pins are closed
        self.cuda_pool.close()

    def _cuda_housekeeping(self) -> None:
        try:
            self.cuda_cache.poll()
            self.cuda_cache.sweep()
            self.cuda_pool.reclaim()
        except Exception:
            log.exception("CUDA pool housekeeping failed")

    def _map_inputs_cuda(self, req: P.Request, frames) -> tuple[dict, dict]:
        inputs: dict[str, Any] = {}
        refs: dict[str, P.TensorRef] = {}
        for t in req.tensors:
            dt = P.parse_dtype(t.dtype)
            loc = t.loc
            kind = type(loc)
            if kind is P.ShmLoc:
                if req.host != self.host:
                    raise P.ProtocolError("shared-memory reference from another host")
                arr = self.inputs_cache.view(P.shm_ref(loc), dt, tuple(t.shape))
                if loc.segment not in self.host_reg:
                    # Pinned, so the upload is a DMA straight from the client's slot.
                    self.host_reg.ensure(loc.segment, self.inputs_cache.mapping(loc.segment), readonly=True)
            elif kind is P.InlineLoc:
                buf = frames[loc.frame]
                buf = buf.buffer if hasattr(buf, "buffer") else memoryview(buf)
                arr = np.frombuffer(buf, dtype=dt).reshape(t.shape) if dt.itemsize else np.empty(t.shape, dt)
                arr.flags.writeable = False
            else:
                if req.host != self.host:
                    raise P.ProtocolError("CUDA IPC reference from another host")
                arr = self.cuda_cache.view(loc, dt, tuple(t.shape), stream=self.stream)
                if not self._device_path:
                    # A numpy model reads host memory: one copy, ordered after the producer.
                    with self._torch.cuda.stream(self.stream):
                        host = arr.to("cpu", non_blocking=True)
                    self.stream.synchronize()
                    arr = host.numpy()
                    arr.flags.writeable = False
                self._pending_cuda_in = True
            inputs[t.name] = arr
            refs[t.name] = t
        return inputs, refs

    def _wants_device(self, job: _Job) -> bool:
        req = job.req
        return (req.reply == "cuda" or (req.reply == "auto" and job.cuda_in)) and req.host == self.host

    def _run_host(self, jobs: list[_Job]):
        return self.backend.run([j.inputs for j in jobs])

    def _run_cuda(self, jobs: list[_Job]):
        try:
            if self._device_path and any(j.cuda_in or self._wants_device(j) for j in jobs):
                return self.backend.run_device([j.inputs for j in jobs], stream=self.stream)
            return self.backend.run([j.inputs for j in jobs])
        except self._torch.cuda.OutOfMemoryError:
            self.mem.on_oom()
            raise

    def _np_dtype(self, tdtype) -> np.dtype:
        dt = self._np_dtypes.get(tdtype)
        if dt is None:
            dt = self._np_dtypes[tdtype] = self._torch.empty(0, dtype=tdtype).numpy().dtype
        return dt

    def _device_outputs(self, job: _Job, out: dict) -> list[P.TensorRef] | None:
        """Outputs copied into our device pool and handed off (CudaLoc), or None when the
        pool is full (the caller then replies through host memory)."""
        torch = self._torch
        pool = self.cuda_pool
        handed = []
        refs = []
        try:
            with torch.cuda.stream(self.stream):
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
                    loc = P.cuda_loc(pool.hand_off(dst, stream=self.stream, holder_pid=job.req.pid))
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
        torch = self._torch
        fetched = {}
        with torch.cuda.stream(self.stream):
            for k, v in out.items():
                fetched[k] = v.to("cpu", non_blocking=True) if isinstance(v, torch.Tensor) else v
        # Host outputs are complete before FINAL, which also orders our reads of CUDA inputs
        # before the client frees them (docs/gpu.md, section 3).
        self.stream.synchronize()
        return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in fetched.items()}

    # ------------------------------------------------------------------ lifecycle

    def _warmup(self) -> None:
        from gpu_worker.backends import warmup

        t0 = time.perf_counter()
        sizes = sorted({1, self.batcher.max_batch})
        warmup(self.backend, self.model, sizes)           # lazy init: allocator, kernels, CUDA context
        self._compute_ewma.update(warmup(self.backend, self.model, sizes))  # steady-state times
        log.info("warm-up of %s on %s took %.1f ms", self.model.name, self.device, (time.perf_counter() - t0) * 1e3)

    def _open_socket(self) -> zmq.Socket:
        """(Re)open the DEALER to `cfg.broker`."""
        if self.sock is not None:
            self.sock.close(linger=0)
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 0
        s.rcvhwm = s.sndhwm = 100_000
        s.connect(self.cfg.broker)
        self.sock = s
        return s

    def _connect(self) -> None:
        s = self._open_socket()
        caps = P.Ready(
            credit=self.credit,
            max_batch=self.batcher.max_batch,
            host=self.host,
            transports=list(self.transports),
            pid=self.pid,
        )
        s.send_multipart(P.worker_ready(self.service, caps))
        self._last_sent = self._last_heard = time.monotonic()

    def close(self) -> None:
        for sock in self._direct.values():
            sock.close(linger=DIRECT_LINGER_MS)
        self._direct.clear()
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self.cuda:
            self._close_cuda()
        self.inputs_cache.close()
        if self.out_pool is not None:
            self.out_pool.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def serve(self, ready_cb=None) -> None:
        """Run until `self.stop` is set; then drain what is held and DISCONNECT."""
        self._connect()
        self._offload = _ComputeThread(self.ctx, self._runner)
        if ready_cb is not None:
            ready_cb()
        interval = self.cfg.heartbeat_interval
        dead_after = interval * self.cfg.heartbeat_liveness
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._offload.done, zmq.POLLIN)
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                wake = None if self._busy else self.batcher.wake_at(now)
                timeout = interval if wake is None else max(0.0, min(interval, wake - now))
                ms = timeout * 1000.0
                if self._done:
                    # Whole milliseconds, rounded up: zmq_poll truncates, and a DONE can
                    # afford to be late where spinning until it is due cannot.
                    ms = min(ms, math.ceil(max(0.0, self._done_due - now) * 1000.0))
                events = dict(poller.poll(ms))
                if self._offload.done in events:
                    self._finish_offloaded()
                if self.sock in events:
                    self._drain()
                    self._last_heard = time.monotonic()
                if not self._busy:
                    self._run_ready_batches()
                now = time.monotonic()
                if self._done and (now >= self._done_due or len(self._done) >= self._done_max):
                    self._flush_done()
                if now - self._last_sent >= interval:
                    self._send(P.worker_heartbeat())
                    if self.cuda:
                        self._cuda_housekeeping()
                if now - self._last_heard > dead_after:
                    log.warning("broker silent for %.1f s; reconnecting", now - self._last_heard)
                    poller.unregister(self.sock)
                    self._fail_pending("broker connection lost")
                    self._connect()
                    poller.register(self.sock, zmq.POLLIN)
            # Drain: what the broker already handed us is finished, then we say goodbye.
            self._drain()
            while self._busy or len(self.batcher):
                if self._busy:
                    if self._offload.done.poll(interval * 1000.0):
                        self._finish_offloaded()
                    else:
                        self._send(P.worker_heartbeat())
                    continue
                self._run_ready_batches(force=True)
            self._flush_done()
            self._send(P.worker_disconnect())
        finally:
            self._offload.close()

    def _send(self, frames) -> None:
        send_frames(self.sock, frames)
        self._last_sent = time.monotonic()

    # ------------------------------------------------------------------ receiving

    def _drain(self) -> None:
        # EVENTS instead of recv(NOBLOCK) + zmq.Again: no exception per wake-up.
        sock = self.sock
        while sock.get(zmq.EVENTS) & _POLLIN:
            frames = recv_frames(sock)
            try:
                self._on_message(frames)
            except Exception:
                log.exception("unexpected error while handling a message from the broker; dropped it")

    def _on_message(self, frames) -> None:
        try:
            msg = P.parse_broker_to_worker(frames)
        except P.ProtocolError as e:
            log.warning("malformed message from broker: %s", e)
            return
        cmd = msg.command
        if cmd == P.W_REQUEST:
            self._on_request(msg.envelope, msg.body)
        elif cmd == P.W_CANCEL:
            job = self.jobs.get(msg.envelope)
            if job is not None:
                self.batcher.drop(lambda p: p.item is job)
                del self.jobs[msg.envelope]
                self._reply_error(job, P.ErrorCode.CANCELLED, "cancelled by the client before it ran")
        elif cmd == P.W_DISCONNECT:
            log.info("broker asked us to reconnect")
            self._fail_pending("broker restarted")
            self._connect()

    def _on_request(self, envelope: bytes, body: tuple) -> None:
        now = time.monotonic()
        if not body or not P.is_header(body[0]):
            job = _Job(envelope, None, None, body, now, None, None)
            if not getattr(self.model, "accepts_opaque", self.model.name == "echo"):
                self._reply_error(job, P.ErrorCode.PROTOCOL_ERROR,
                                  f"service {self.service!r} takes tensor requests; send a header frame (docs/protocol.md)")
                return
            # Opaque MDP bodies go straight back: they have no tensors to batch.
            self._send(P.worker_reply(envelope, True, body))
            self.served += 1
            return
        rest = body[1:]
        try:
            req = P.decode_request(body[0], n_inline=len(rest))
            P.check_inline_sizes(req.tensors, rest)
        except P.ProtocolError as e:
            job = _Job(envelope, P.Request(id=0), None, None, now, None, None)
            self._reply_error(job, e.code, str(e))
            return
        job = _Job(envelope, req, None, None, now, None, None)
        if self.cuda:
            try:
                self.mem.admit()
            except self._GpuMemoryPressure as e:
                self._reply_error(job, P.ErrorCode.QUEUE_FULL, str(e))
                return
            self._pending_cuda_in = False
        try:
            t0 = time.perf_counter()
            job.inputs, job.refs = self._map_inputs(req, rest)
            job.input_ms = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # a stale/forged reference fails this request only
            if self.cuda:
                job.cuda_in = self._pending_cuda_in
            self._reply_error(job, P.ErrorCode.PROTOCOL_ERROR, f"cannot read inputs: {e}")
            return
        if self.cuda:
            job.cuda_in = self._pending_cuda_in
        if req.timeout_ms is not None:
            job.deadline = now + req.timeout_ms / 1000.0
            if req.timeout_ms <= 0:
                self._reply_error(job, P.ErrorCode.DEADLINE_EXCEEDED, "deadline passed before the worker got the request")
                return
        key = tuple((t.name, t.dtype, tuple(t.shape)) for t in req.tensors)
        try:
            cost = float(self.model.cost(job.inputs))
        except Exception:
            cost = 1.0
        self.jobs[envelope] = job
        self.batcher.add(Pending(key=key, cost=cost, item=job, arrived=now, deadline=job.deadline), now)

    def _map_inputs(self, req: P.Request, frames) -> tuple[dict, dict]:
        inputs: dict[str, np.ndarray] = {}
        refs: dict[str, P.TensorRef] = {}
        for t in req.tensors:
            dt = P.parse_dtype(t.dtype)
            loc = t.loc
            kind = type(loc)
            if kind is P.ShmLoc:
                if req.host != self.host:
                    raise P.ProtocolError("shared-memory reference from another host")
                arr = self.inputs_cache.view(
                    P.shm_ref(loc), dt, tuple(t.shape)
                )
            elif kind is P.InlineLoc:
                buf = frames[loc.frame]
                buf = buf.buffer if hasattr(buf, "buffer") else memoryview(buf)
                arr = np.frombuffer(buf, dtype=dt).reshape(t.shape) if dt.itemsize else np.empty(t.shape, dt)
                arr.flags.writeable = False
            else:
                raise P.ProtocolError("CUDA IPC tensors are not supported by this worker yet (GPU issue)")
            inputs[t.name] = arr
            refs[t.name] = t
        return inputs, refs

    # ------------------------------------------------------------------ running

    def _run_ready_batches(self, force: bool = False) -> None:
        while not self._busy:
            now = time.monotonic()
            for p in self.batcher.expire(now):
                self.jobs.pop(p.item.envelope, None)
                self._reply_error(p.item, P.ErrorCode.DEADLINE_EXCEEDED, "deadline passed while waiting for a batch")
            if self.cuda:
                # Smaller batches need less activation memory; MemoryWatch halves the cap
                # under pressure and doubles it back.
                self.batcher.max_batch = min(self._max_batch, self.mem.limit())
            batch = self.batcher.take(now, idle=True, force=force)
            if not batch:
                return
            jobs = [p.item for p in batch]
            for job in jobs:
                self.jobs.pop(job.envelope, None)
            self._run(jobs, now)

    def _run(self, jobs: list[_Job], started: float) -> None:
        if getattr(self.model, "streaming", False):
            for job in jobs:
                self._run_stream(job)
            return
        predicted = self._compute_ewma.get(len(jobs))
        if self._offload is not None and (predicted is None or predicted > self.cfg.heartbeat_interval / 2):
            self._busy = True
            self._offload.submit(jobs, started)
            return
        t0 = time.perf_counter()
        try:
            outputs = self._runner(jobs)
            error = None
        except Exception as e:
            outputs, error = None, e
        self._complete(jobs, started, outputs, error, time.perf_counter() - t0)
        if self._busy:  # a batch finished on the loop thread can't leave the flag set
            self._busy = False

    def _finish_offloaded(self) -> None:
        jobs, started, outputs, error, seconds = self._offload.result()
        self._busy = False
        self._complete(jobs, started, outputs, error, seconds)

    def _complete(self, jobs, started, outputs, error, seconds: float) -> None:
        n = len(jobs)
        prev = self._compute_ewma.get(n)
        self._compute_ewma[n] = seconds if prev is None else 0.8 * prev + 0.2 * seconds
        if error is not None:
            log.error("model %s failed on a batch of %d: %r", self.model.name, n, error)
            for job in jobs:
                self._reply_error(
                    job, P.ErrorCode.INTERNAL, f"model {self.model.name!r} raised {type(error).__name__}: {error}"
                )
            return
        compute_ms = seconds * 1e3
        if n > 1:
            self._coalesce = {}
        try:
            self._reply_batch(jobs, outputs, started, compute_ms, n)
        finally:
            self._send_coalesced()
        self.served += n

    def _reply_batch(self, jobs, outputs, started, compute_ms: float, n: int) -> None:
        for job, out in zip(jobs, outputs):
            timing = {
                "batch_wait_ms": (started - job.received) * 1e3,
                "input_ms": job.input_ms,
                "compute_ms": compute_ms,
                "batch": float(n),
            }
            if job.req.queue_ms is not None:
                timing["queue_ms"] = job.req.queue_ms
            try:
                self._reply_tensors(job, out, timing, final=True)
            except Exception as e:  # one bad output must not take the worker (and its other requests) down
                log.exception("could not send the outputs of request %d", job.req.id)
                self._reply_error(job, P.ErrorCode.INTERNAL, f"could not send outputs: {type(e).__name__}: {e}")

    def _send_coalesced(self) -> None:
        """Send the header-only FINALs gathered while a batch was answered: one message per
        client (FINALS), instead of one per request."""
        pending, self._coalesce = self._coalesce, None
        if not pending:
            return
        for endpoint, items in pending.items():
            heads = [head for head, _ in items]
            frames = (P.client_reply(True, self._service_b, heads) if len(heads) == 1
                      else P.direct_finals(self._service_b, heads))
            sock = self._direct.get(endpoint)  # None: closed since (least recently used)
            try:
                if sock is not None:
                    send_frames(sock, frames, NOBLOCK)
            except zmq.ZMQError:  # full, or the socket failed
                sock = None
            if sock is None:  # relay each through the broker instead
                for head, job in items:
                    self._send(P.worker_reply(job.envelope, True, [head]))
                continue
            for _, job in items:
                self._note_done(job)
            self.direct_sent += len(items)

    def _run_stream(self, job: _Job) -> None:
        seq = 0
        t0 = time.perf_counter()
        for out in self.backend.run_stream(job.inputs):
            self._reply_tensors(job, out, {"compute_ms": (time.perf_counter() - t0) * 1e3}, final=False, seq=seq)
            seq += 1
        self._send(P.worker_reply(job.envelope, True, [P.encode_header(P.Reply(id=job.req.id, seq=seq))]))
        self.served += 1

    # ------------------------------------------------------------------ replying

    def _reply_tensors(self, job: _Job, out: dict, timing: dict, *, final: bool, seq: int = 0) -> None:
        t0 = time.perf_counter()
        req = job.req
        if self.cuda:
            if self._wants_device(job):
                refs = self._device_outputs(job, out)
                if refs is not None:
                    timing["output_ms"] = (time.perf_counter() - t0) * 1e3
                    header = P.encode_header(P.Reply(id=req.id, tensors=refs, timing=timing, seq=seq))
                    self._reply(job, final, [header])
                    return
                # Device pool full (the client holds many results): degrade to host memory.
            if any(isinstance(v, self._torch.Tensor) for v in out.values()):
                out = self._to_host(out)
        want_shm = self.out_pool is not None and (
            req.reply == "shm" or (req.reply != "inline" and req.host == self.host)
        )
        refs: list[P.TensorRef] = []
        frames: list[Any] = []
        for name, value in out.items():
            arr = np.asarray(value)
            same = job.inputs.get(name) if job.inputs else None
            if same is not None and type(job.refs[name].loc) is P.ShmLoc and req.reply != "inline" and _is_same_array(arr, same):
                # Identity output: hand back the client's own reference; no byte moves.
                refs.append(P.TensorRef(name=name, dtype=job.refs[name].dtype, shape=list(arr.shape), loc=job.refs[name].loc))
                continue
            dts = arr.dtype.str
            if want_shm:
                buf = self.out_pool.try_alloc(arr.shape, arr.dtype)
                if buf is not None:
                    np.copyto(buf, arr)
                    ref = self.out_pool.ref_of(buf)
                    self.out_pool.mark_in_flight(ref, holder_pid=req.pid)
                    refs.append(P.TensorRef(name=name, dtype=dts, shape=list(arr.shape),
                                            loc=P.shm_loc(ref)))
                    continue
                # Output ring full (the client holds many results): degrade to inline, never fail.
            if not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)
            refs.append(P.TensorRef(name=name, dtype=dts, shape=list(arr.shape), loc=P.InlineLoc(frame=len(frames))))
            # Raw bytes view: the buffer protocol refuses some dtypes (datetime64) as typed views.
            frames.append(arr.reshape(-1).view(np.uint8).data if arr.nbytes else b"")
        timing["output_ms"] = (time.perf_counter() - t0) * 1e3
        header = P.encode_header(P.Reply(id=req.id, tensors=refs, timing=timing, seq=seq))
        self._reply(job, final, [header, *frames])

    def _reply_error(self, job: _Job, code: int, message: str) -> None:
        rid = job.req.id if job.req is not None else 0
        if job.cuda_in:
            # The client frees its input slots at FINAL: our queued reads must be done.
            try:
                self.stream.synchronize()
            except Exception:
                log.exception("could not synchronise the worker stream before an error reply")
        self._reply(job, True, P.error_body(rid, code, message))

    def _reply(self, job: _Job, final: bool, body: list) -> None:
        """Send one reply: a FINAL straight to a same-host client that gave a reply_to
        socket (direct reply), anything else through the broker."""
        req = job.req
        if (final and req is not None and req.reply_to is not None and req.host == self.host
                and self.cfg.direct_reply and not self._streaming):
            sock = self._direct_socket(req.reply_to)
            if sock is not None and self._coalesce is not None and len(body) == 1:
                self._coalesce.setdefault(req.reply_to, []).append((body[0], job))
                return
            if sock is not None:
                try:
                    send_frames(sock, P.client_reply(True, self._service_b, body), NOBLOCK)
                except zmq.Again:
                    # Full: the client stopped reading, or died.  The replies already queued
                    # stay queued (they were told to the broker as DONE); this one goes
                    # through the broker, which knows whether the client is still there.
                    pass
                except zmq.ZMQError as e:
                    log.warning("direct reply to %s failed (%s); relaying through the broker", req.reply_to, e)
                    self._drop_direct(req.reply_to)
                else:
                    self._note_done(job)
                    self.direct_sent += 1
                    return
        self._send(P.worker_reply(job.envelope, final, body))

    def _direct_socket(self, endpoint: str) -> zmq.Socket | None:
        sock = self._direct.get(endpoint)
        if sock is not None:
            self._direct.move_to_end(endpoint)
            return sock
        if not os.path.exists(endpoint[len("ipc://"):]):
            # Not visible from here (another mount namespace, or the client is gone): a
            # connect would queue replies forever, so relay instead.
            return None
        sock = None
        try:
            sock = self.ctx.socket(zmq.PUSH)
            sock.linger = 0
            # A client that stops reading costs at most this many queued replies before
            # the worker falls back to relaying (and reconnects afresh).
            sock.sndhwm = 1000
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            if sock is not None:
                sock.close(linger=0)
            log.warning("cannot connect to reply_to %s (%s); relaying through the broker", endpoint, e)
            return None
        self._direct[endpoint] = sock
        while len(self._direct) > max(1, self.cfg.direct_sockets):
            _, old = self._direct.popitem(last=False)
            old.close(linger=DIRECT_LINGER_MS)
        return sock

    def _drop_direct(self, endpoint: str) -> None:
        sock = self._direct.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def _note_done(self, job: _Job) -> None:
        """Remember that `job`'s FINAL went straight to its client.  DONEs are gathered:
        one message for several FINALs costs the broker one wake-up instead of several, and
        on a small machine that wake-up competes with the client the FINAL just woke.  The
        broker's credit count lags by at most `done_batch` requests or `done_delay` seconds,
        and a DONE goes out within half the time the request had left, so the broker hears
        of it before it would time the request out."""
        now = time.monotonic()
        due = now + self.cfg.done_delay
        if job.deadline is not None:
            due = min(due, now + max(0.0, job.deadline - now) / 2)
        if not self._done or due < self._done_due:
            self._done_due = due
        self._done.append(job.envelope)

    def _flush_done(self) -> None:
        """Tell the broker which FINALs went straight to their clients (returns our credit)."""
        done, self._done = self._done, []
        for i in range(0, len(done), P.MAX_DONE):
            self._send(P.worker_done(done[i : i + P.MAX_DONE]))

    def _fail_pending(self, why: str) -> None:
        # The broker retries these elsewhere; our replies would carry dead tokens.
        self.batcher.drop(lambda p: True)
        self.jobs.clear()
        self._done.clear()


class _ComputeThread:
    """One thread that runs offloaded batches; it signals completion on an inproc PAIR
    socket so the worker's poll wakes up (a zmq socket may not be shared across threads,
    but each end of the pair is used by one thread only)."""

    _n = 0

    def __init__(self, ctx: zmq.Context, run):
        _ComputeThread._n += 1
        addr = f"inproc://gpu-worker-done-{os.getpid()}-{_ComputeThread._n}"
        self.done = ctx.socket(zmq.PAIR)
        self.done.linger = 0
        self.done.bind(addr)
        self._tx = ctx.socket(zmq.PAIR)
        self._tx.linger = 0
        self._tx.connect(addr)
        self._run = run  # jobs -> outputs (the worker's host or CUDA runner)
        self._job = None
        self._out = None
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="compute", daemon=True)
        self._thread.start()

    def submit(self, jobs, started) -> None:
        with self._cv:
            self._job = (jobs, started)
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                jobs, started = self._job
                self._job = None
            t0 = time.perf_counter()
            try:
                outputs, error = self._run(jobs), None
            except Exception as e:
                outputs, error = None, e
            self._out = (jobs, started, outputs, error, time.perf_counter() - t0)
            self._tx.send(b"")

    def result(self):
        self.done.recv()
        out, self._out = self._out, None
        return out

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(5)
        self._tx.close(linger=0)
        self.done.close(linger=0)


def _is_same_array(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.flags.c_contiguous
    )


def install_sigterm_drain(worker: Worker) -> None:
    signal.signal(signal.SIGTERM, lambda *_: worker.stop.set())
    signal.signal(signal.SIGINT, lambda *_: worker.stop.set())
