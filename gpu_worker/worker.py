"""The worker process: one model, one MDP/0.2 worker socket, dynamic batching.

Loop (one thread, on purpose: a lone request goes from socket to model with no thread
hand-off, and the GIL makes a separate I/O thread compete with the model's Python code):

    poll(socket, until the batcher's wake-up, the next DONE, heartbeat or keep-warm unit)
    drain every delivered message: REQUEST -> inputs mapped in place -> batcher
                                   CANCEL  -> drop if still pending (499); running: drop its result
                                   RECALL  -> give back what has not started (RETURNED)
    if the batcher yields a batch: run it, write outputs, send FINALs
    DONE for direct replies / heartbeat / broker liveness / reconnect (Paranoid Pirate)
    idle and a keep-warm unit due: run it (a batch of one, small; gpu_worker.keepwarm.KeepWarm)

While a batch computes, new requests wait in the socket; when it finishes they are all taken
at once, so batches grow with load and a lone request under light load is never delayed.
(A batch on the loop's own thread lends both sockets to the heartbeat thread meanwhile:
`_read_while_computing` stashes what arrives with its arrival time, answers RECALLs, and
sends a lease's request that would wait behind another's long batch through the broker.)

Head of line with leases (docs/protocol.md section 10.3): a batch or stream that runs long
(`leases.runs_long`) is told to the broker (BUSY on, then off), since the broker cannot
see leased work, nor how long a brokered batch runs; a leased request that would wait behind a long
batch holding none of its lease's requests is answered 429 "send it through the broker".

This module is the loop and nothing else; each decision it acts on lives with its job:

    gpu_worker.batching    which pending requests form the next batch, and when (pure)
    gpu_worker.compute     whether a batch leaves the loop's thread (pure), and that thread
    gpu_worker.planes      where tensors live: inputs mapped, batches run, outputs written
                           (HostPlane; gpu_worker.cuda_plane.CudaPlane on a CUDA worker)
    gpu_worker.direct      which FINALs skip the broker, and the DONEs that say so (pure),
                           and the sockets to clients' reply_to
    gpu_worker.upstream    the broker connection (or whatever stands in for it)
    gpu_worker.leases      leases (--direct): the direct socket, and which of its requests
                           may run (pure); they run here like brokered ones, and their
                           replies go back on the direct socket

Invariants a maintainer must keep: every request the broker hands over gets exactly one
FINAL (a reply or a typed error), or is given back unstarted (RETURNED, asked by a RECALL),
unless the broker connection is lost first; every RECALL is answered; the loop never
blocks for longer than one batch computed on its own thread (so heartbeats keep flowing);
nothing here branches on the device - the plane chosen at start does.

SIGTERM drains: stop reading new work, end the leases (LEASE_END to the broker; direct
REQUESTs from then on get 503), finish what is held, send DISCONNECT, exit 0.
"""
from __future__ import annotations

import heapq
import logging
import math
import os
import signal
import socket
import stat
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, replace as _replace
from typing import NamedTuple

import zmq

from broker import protocol as P
from broker.protocol import logs
from broker.protocol.wire import TcpWatch, Waiter, quiet_fd, recv_frames, sock_events, touched
from gpu_worker.batching import Batcher, Pending
from gpu_worker.compute import ComputeThread, ComputeTimes, LoopHeartbeats, message_of, raised
from gpu_worker.signature import describe, mismatch, parse_inputs, wire_signature
from gpu_worker.direct import DIRECT_LINGER_MS, BatchFinals, DirectSockets, DoneGather, direct_endpoint, gathers_finals
from gpu_worker.job import Job
from gpu_worker.leases import LINK_CONNS, DirectSocket, DirectSocketError, LeaseTable, Refusal, Unsent, runs_long
from gpu_worker.planes import (DataPlane, HostPlane, NotAttested, OutputRefused, ReplyTooLarge, check_outputs,
                               reply_sockets)
from gpu_worker.tracing import from_env as tracing_from_env
from gpu_worker.upstream import BrokerLink
from broker.protocol.stats import BATCH_BUCKETS, LATENCY_BUCKETS, Histogram
from broker.protocol.heap import BurstSeen, ClosesSeen, start_trim
from broker.protocol.limits import Headroom, memory_limit, move_aside, nofile_limit, open_descriptors, put_back
from broker.protocol.naming import ipc_problem
from shm.errors import NotShared, OutOfResources, SegmentGone, StaleDescriptor
from shm.segment import ClockPeers, max_capacity

__all__ = ["Worker", "WorkerConfig", "WarmupError", "ConfigError", "install_sigterm_drain", "ignore_other_signals",
           "DIRECT_LINGER_MS"]

log = logging.getLogger("gpu_worker")
_POLLIN = int(zmq.POLLIN)
# How long serve waits for the broker's WELCOME before announcing READY anyway, in heartbeat
# intervals (the command line's): a plain MDP broker never sends one.
READY_FALLBACK_INTERVALS = 2
# Messages the heartbeat thread holds from the direct socket while a batch computes on the
# loop's thread (`_read_direct_while_computing`); the rest waits in the socket (its HWM),
# and `_after_compute` never has more than this to handle at once.  A lease's own traffic
# is bounded by its slots: this is far beyond what all leases send during one batch.
_DIRECT_STASH_MAX = 256


def _arrival(entry: tuple) -> float:
    """What `_after_compute` orders the heartbeat thread's reads by: their arrival time."""
    return entry[0]


def _request_faults() -> tuple:
    """What a model's run may raise that is the request's fault, not the model's (INVALID_INPUT):
    an input the backend's framework cannot hold, and what the model refused itself.  (Imported
    here, on the error path: the worker module loads neither backends nor models at import.)"""
    from gpu_worker.backends import UnsupportedInput
    from gpu_worker.models import InvalidInput

    return UnsupportedInput, InvalidInput


def ring_too_large(out_capacity: int, limit: int | None) -> str | None:
    """Words for a start where the output ring is more than half the memory the worker may
    use (``limit``: its cgroup's, else the machine's): the ring's pages count against the
    worker as its replies are written, moving through the whole ring, and a worker in a
    200 MiB cgroup with the default 256 MiB ring was OOM-killed by its fourth 40 MiB reply
    (the memory audit).  None when it fits."""
    if limit is None or out_capacity <= limit // 2:
        return None
    return (f"the output ring ({out_capacity >> 20} MiB, --out-capacity-mb) is more than half the memory this worker "
            f"may use ({limit >> 20} MiB: its cgroup's limit, else the machine's); its pages count against the "
            f"worker as replies are written, and it may be OOM-killed: lower --out-capacity-mb, or raise its memory")


#: bytes of a request's or reply's inline frames from which they count as big (`BurstSeen`)
_BIG_FRAMES = 64 << 10


def _output_faults() -> tuple:
    """What says a model returned outputs that cannot be used: not a dict, without the
    batch's leading axis, of a type no array takes (`backends.BadOutputs`), or that no reply
    can carry (`planes.OutputRefused`).  (Imported here, as `_request_faults`.)"""
    from gpu_worker.backends import BadOutputs

    return BadOutputs, OutputRefused


def refused_outputs(model: str, e: BaseException) -> str:
    """An error reply's words for outputs the model returned that cannot be used or sent
    (`_output_faults`): the model's mistake, which the same request meets again, so its
    client is not told that retrying may help (`client_sdk.InternalError`)."""
    # (the words the client looks for first: a long output name in the message may be cut)
    if isinstance(e, ReplyTooLarge):  # (not the model's fault: the broker's limit)
        return (f"model {model[:200]!r} returned an output too large for a reply through the broker (the same request "
                f"fails the same way): {message_of(e)}")
    return (f"model {model[:200]!r} returned outputs no reply can carry (a fault of the model: the same request "
            f"fails the same way; fix the model): {message_of(e)}")


def _check_each(outs: list) -> None:
    """`check_outputs` on each request's outputs of a batch, so that outputs no reply can
    carry fail the batch as if the model had raised (`Worker._run_model` runs it again in
    halves).  Checked only at the reply, they failed every request of the batch, though one
    request's inputs alone made the model return them (the models audit).  A batch of one
    needs no check here: its reply checks its outputs, with the same words; a larger one's
    replies do not check them again (`write_outputs`' ``checked``)."""
    for out in outs:
        check_outputs(out)


def _failed_how(e: BaseException, n: int) -> tuple[str, int, str]:
    """How a batch of ``n`` failed, for a log line's ``model NAME %s on a batch of %d (%s)``:
    outputs no reply can carry (`_output_faults`: the model returned them, it raised
    nothing), with the reason; else what the model raised, with its type and message."""
    if isinstance(e, _output_faults()):
        return "returned outputs no reply can carry", n, message_of(e)
    return "raised", n, raised(e)


class LaneFault(BaseException):
    """An unexpected error of the worker's own while it ran a batch in the lone-request lane
    (`Worker._admit`): raised past the drains' per-message handlers, which would drop it and
    go on with the batch half done, so that it ends `serve` as the same error from
    `run_ready_batches` does."""


class ModelFailed:
    """In a batch's outputs, in place of one request's: what the model raised on it."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


#: The serving worker's pid (`Worker.__init__`).  A model that forks (a helper process) and
#: whose child raises, `sys.exit()` included, or returns, leaves that child in the worker's
#: own code, over the parent's sockets: it spun at full CPU, ignored SIGTERM and outlived the
#: worker (the fork hunt).  Such a child ends there, as Python would end it.
_SERVING_PID = [0]


def end_forked_child(e: BaseException | None = None) -> None:
    """In a process a model forked from the worker (not the worker itself): exit now, with
    what ``e`` says (`SystemExit`'s code; 1 and the traceback on stderr for another
    exception; 0 when the model's call returned).  Nothing of the worker's runs in it."""
    pid = _SERVING_PID[0]
    if not pid or os.getpid() == pid:
        return
    code = 0
    try:
        if isinstance(e, SystemExit):
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        elif e is not None:
            code = 1
            traceback.print_exception(e)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # nothing may keep it from exiting
        pass
    os._exit(code & 0xFF)


def model_fault(e: BaseException) -> ModelFailed:
    """What a model raised, as a failure of its request: any exception, SystemExit and
    GeneratorExit included (a model's `sys.exit()` must not end the worker, nor, retried by
    the broker, every worker of the service).  A KeyboardInterrupt on the main thread is a
    Ctrl-C, not the model's: it goes on.  In a child the model forked, it ends the child
    (`end_forked_child`)."""
    end_forked_child(e)
    if isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
        raise e
    return ModelFailed(e)


class _Seen(NamedTuple):
    """An example input as `signature.mismatch` reads a request's tensors."""

    name: str
    dtype: str
    shape: tuple


class WarmupError(RuntimeError):
    """The model failed its warm-up on its example inputs (the message is the model's error)."""


class ConfigError(ValueError):
    """A `WorkerConfig` value the worker cannot run with; the message names the option (and
    its command-line flag) and what it takes, in one line."""


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN


def _ms(seconds):
    """A duration the command line gave in ms, shown as typed (the config holds seconds)."""
    return seconds * 1000 if _number(seconds) else seconds


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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
    #: reply_to sockets kept open, one per client process (least recently used closed first);
    #: None: as many as the descriptor limit leaves room for (`planes.reply_sockets`: 256,
    #: or 96 under a hard limit of 1024).  A client past them got a new connection per reply
    direct_sockets: int | None = None
    direct_link: bool = True          # with direct: a local link beside the direct socket (docs/protocol.md 10.6)
    direct_tcp: str | None = None     # with direct: the direct socket on this tcp address (CurveZMQ: worker_key)
    done_delay: float = 0.005         # seconds a DONE may wait to gather more (never past a request's deadline)
    done_batch: int | None = None     # ... or until this many FINALs are pending (default credit // 4)
    drain_grace: float = 30.0         # on stop, seconds outputs stay readable for clients yet to release them
    server_key: str | None = None     # tcp broker: its public certificate or z85 key (CurveZMQ, docs/security.md)
    worker_key: str | None = None     # tcp broker: this worker's secret certificate
    insecure: bool = False            # tcp broker without CurveZMQ
    keep_warm: float | None = None    # idle seconds between keep-warm units; None: 0.05 on CUDA, off on CPU; 0: off
    keep_warm_util: float = 0.6       # ... and only while the busy fraction of the recent window is at most this
    batching: str = "latency"         # "latency": wait for company only with a broker backlog; "throughput": on arrival rates
    lifo_after: float | None = 0.1    # s: a group over a batch with a deadline loss this recent goes newest first; None: never
    direct: bool = False              # take leases: bind a direct socket, named in Ready.direct (docs/protocol.md section 10)

    def check(self) -> None:
        """`ConfigError` for the first value the worker cannot run with (`Worker` checks
        before it loads anything)."""
        def need(ok: bool, option: str, flag: str | None, what: str, value) -> None:
            if not ok:
                via = f" ({flag})" if flag else ""
                raise ConfigError(f"{option}{via} must be {what}, not {value!r}")

        need(_whole(self.max_batch) and 1 <= self.max_batch <= P.MAX_CREDIT, "max_batch", "--max-batch",
             f"an integer from 1 to {P.MAX_CREDIT}", self.max_batch)
        need(_number(self.max_delay) and 0 <= self.max_delay < float("inf"), "max_delay", "--max-delay-ms",
             "a finite number of ms >= 0", _ms(self.max_delay))
        need(_number(self.max_cost) and self.max_cost > 0, "max_cost", "--max-cost", "a number > 0 (inf: no bound)",
             self.max_cost)
        need(self.credit is None or (_whole(self.credit) and 1 <= self.credit <= P.MAX_CREDIT), "credit",
             "--credit", f"an integer from 1 to {P.MAX_CREDIT} (or unset: 2 x max-batch)", self.credit)
        # The broker's bounds, which a WELCOME carries (1e16 s overflowed the loop's wait after
        # READY; 1e-9 s was a busy loop: the command-line hunt).
        need(_number(self.heartbeat_interval) and 0.001 <= self.heartbeat_interval <= 3600, "heartbeat_interval",
             "--heartbeat-interval", "a number of seconds from 0.001 to 3600", self.heartbeat_interval)
        need(_whole(self.heartbeat_liveness) and 2 <= self.heartbeat_liveness <= 1000, "heartbeat_liveness",
             "--heartbeat-liveness", "an integer from 2 to 1000 (1: one heartbeat a moment late reads as a death)",
             self.heartbeat_liveness)
        window = self.heartbeat_interval * self.heartbeat_liveness
        if window < P.MIN_LIVENESS_WINDOW:
            raise ConfigError(f"heartbeat_interval x heartbeat_liveness (--heartbeat-interval x --heartbeat-liveness, "
                              f"the liveness window) must be at least {P.MIN_LIVENESS_WINDOW} s, not "
                              f"{self.heartbeat_interval:g} x {self.heartbeat_liveness}: shorter, ordinary pauses "
                              f"of a live process read as deaths")
        need(_whole(self.out_slots) and self.out_slots >= 1, "out_slots", None, "an integer >= 1", self.out_slots)
        most = max_capacity(min(self.out_slots, 1 << 20) if _whole(self.out_slots) else 4096)
        need(_whole(self.out_capacity) and 0 < self.out_capacity <= most, "out_capacity", "--out-capacity-mb",
             f"a size > 0 and at most {most >> 20} MiB (what a client maps of a worker's ring)", self.out_capacity)
        need(bool(self.transports) and all(t in P.TRANSPORTS for t in self.transports), "transports",
             "--transports", f"a non-empty list of {', '.join(sorted(P.TRANSPORTS))}", ",".join(self.transports))
        need(self.backend in ("auto", "torch", "numpy", "tensorrt"), "backend", "--backend",
             "auto, torch, numpy or tensorrt", self.backend)
        need(_whole(self.cuda_pool_capacity) and self.cuda_pool_capacity > 0, "cuda_pool_capacity", "--cuda-pool-mb",
             "a size > 0", self.cuda_pool_capacity)
        need(_whole(self.cuda_pool_slots) and self.cuda_pool_slots >= 1, "cuda_pool_slots", None,
             "an integer >= 1", self.cuda_pool_slots)
        need(self.direct_sockets is None or (_whole(self.direct_sockets) and self.direct_sockets >= 1),
             "direct_sockets", None, "an integer >= 1 (or None)", self.direct_sockets)
        need(_number(self.done_delay) and 0 <= self.done_delay < float("inf"), "done_delay", "--done-delay-ms",
             "a finite number of ms >= 0", _ms(self.done_delay))
        need(self.done_batch is None or (_whole(self.done_batch) and self.done_batch >= 1), "done_batch", None,
             "an integer >= 1 (or unset)", self.done_batch)
        need(_number(self.drain_grace) and 0 <= self.drain_grace < float("inf"), "drain_grace", "--drain-grace-s",
             "a finite number of seconds >= 0", self.drain_grace)
        need(self.keep_warm is None or (_number(self.keep_warm) and (self.keep_warm == 0 or 0.001 <= self.keep_warm
                                                                     <= 86400)),
             "keep_warm", "--keep-warm-ms", "0 (off), or a number of ms from 1 to 86400000 (a day)",
             _ms(self.keep_warm))
        need(_number(self.keep_warm_util) and 0 <= self.keep_warm_util <= 1, "keep_warm_util", "--keep-warm-util",
             "a fraction between 0 and 1", self.keep_warm_util)
        need(self.batching in ("latency", "throughput"), "batching", "--batching", "'latency' or 'throughput'",
             self.batching)
        need(self.lifo_after is None or (_number(self.lifo_after) and 0 <= self.lifo_after <= 86400), "lifo_after",
             "--lifo-after-ms", "a number of ms from 0 to 86400000 (a day), or negative (never)", _ms(self.lifo_after))
        if self.service is not None:
            from gpu_worker.models import name_problem

            why = name_problem(self.service, "service name")
            if why is not None:
                raise ConfigError(f"--service: {why}")



#: a leased stream's reply that finds the local link's backlog at its cap waits for its
#: client to read it below (`LinkServer.send`): as long as some of it leaves every this many
#: seconds, four times as long at most.  The stream goes at the pace its client reads; a
#: client that reads nothing that long, or too slowly, loses its connection (its calls go
#: through the broker), as before
STREAM_WAIT_S = 0.5
#: a loop pass this many seconds later than its wait allowed (a quarter of the broker's
#: liveness window at most) means the worker did not run: stopped, frozen, starved
#: (`Worker._resumed`)
PAUSED_S = 0.25

#: seconds a leased request's outcome waits for the STATS that counts it, at most while the
#: loop runs (the broker never sees a leased FINAL: a worker's death loses what waits)
LEASED_STATS_S = 0.05

#: `Job.cancelled` of a leased stream whose partial could not be sent (truthy: it stops)
_UNSENDABLE = "unsendable"
#: `Job.cancelled` of a leased stream whose client stopped reading its replies on the direct
#: socket (its queue stayed full for STREAM_WAIT_S): it stops with an error FINAL, held for
#: the client (`_held`)
_UNREAD = "unread"

#: a leased FINAL that met its connection's full queue on the direct socket (its client
#: alive, not reading) is held and tried again on each pass of the loop, which then waits at
#: most this long (libzmq says nothing when that one connection has room again)
HELD_RETRY_S = 0.01
#: refusals (FINALs of requests that never ran: 400, 429, 503) held at most, all
#: connections together; a leased request's own FINAL is bounded by its lease's slots
HELD_REFUSALS = 1024
#: `Job.cancelled` by a CANCEL whose caller's deadline had passed (`Cancel.expired`): answered
#: and counted as DEADLINE_EXCEEDED, as the broker counts a brokered request's
_EXPIRED = "expired"
#: `Job.cancelled` by the broker because its client left (a worker CANCEL's reason)
_GONE = "client gone"

def _refusal(body) -> str | None:
    """The reason a DISCONNECT carries (the broker refused our READY), or None: a plain one."""
    if not body:
        return None
    try:
        err = P.decode_reply(body[0]).error
    except P.ProtocolError:
        return "(a reason that does not parse)"
    return None if err is None else err.message


class Worker:
    """One model served to one broker.  ``upstream`` replaces the broker connection
    (`gpu_worker.upstream`; default `BrokerLink(cfg.broker)`); the worker closes it.
    ``tracing``: a `gpu_worker.tracing.Tracing` for OpenTelemetry spans (default: from the
    OTEL_* environment, None when it asks for none)."""

    def __init__(self, cfg: WorkerConfig, *, ctx: zmq.Context | None = None, upstream=None, tracing=None):
        from gpu_worker.backends import make_backend
        from gpu_worker.devices import resolve_device
        from gpu_worker.models import load_model

        cfg.check()  # ConfigError: one line naming the option, before anything is loaded
        self.cfg = cfg
        self._oops = P.RateLimitedLog(log)  # a traceback a second at most, whatever a peer sends
        self._isolate_log = P.RateLimitedLog(log)  # (`_run_model`: one batch at a time, on either thread)
        self._cost_log = P.RateLimitedLog(log)  # a cost() that fails on every request says so once a second
        self._too_large = P.RateLimitedLog(log)  # outputs over the broker's reply-frame limit (a client asks for them)
        # A broker that stays down: its first silence is a WARNING, the reconnects after it
        # one line a minute with their count (one every liveness window filled the log).
        self._silence_log = P.RateLimitedLog(log, every=60.0)
        self.device = resolve_device(cfg.device)
        if "cuda" in cfg.transports and not self.device.startswith("cuda"):
            # READY would advertise it, and clients would send device descriptors a CPU
            # worker cannot open (the command-line hunt).  Asked of a device chosen here
            # (auto: one pool's flags for hosts with and without a GPU), it is left out.
            left = tuple(t for t in cfg.transports if t != "cuda")
            if str(cfg.device or "auto").strip().lower() != "auto" or not left:
                raise ConfigError(f"transports (--transports) has cuda, which needs a CUDA device; this worker runs "
                                  f"on {self.device}: leave cuda out")
            log.warning("--transports has cuda, and no CUDA device is here (--device auto chose %s): left out",
                        self.device)
            cfg = self.cfg = _replace(cfg, transports=left)
        # From here on, a child the model forks (in its factory, its warm-up, a keep-warm
        # unit: not only in a batch) ends where it leaves the model's code, instead of going
        # on as a second worker over the same broker and output ring (`end_forked_child`).
        _SERVING_PID[0] = os.getpid()
        try:
            self.model = load_model(cfg.model, self.device)
        except BaseException as e:
            end_forked_child(e)
            raise
        end_forked_child()
        self.service = cfg.service or self.model.name
        max_batch = cfg.max_batch if getattr(self.model, "batchable", False) else 1
        if cfg.credit is not None and cfg.credit < max_batch:
            # The broker never hands us more than our credit at once, so a batch of more
            # could never fill: under a backlog each one would wait out max_delay for
            # company that cannot come (the command-line hunt).
            log.warning("--credit %d is below --max-batch %d: batches hold at most %d requests",
                        cfg.credit, max_batch, cfg.credit)
            max_batch = cfg.credit
        self.backend = make_backend(self.model, self.device, cfg.backend,
                                    **({"max_batch": max_batch} if cfg.backend == "tensorrt" else {}))
        self.batcher = Batcher(max_batch=max_batch, max_cost=cfg.max_cost, max_delay=cfg.max_delay,
                               latency_first=cfg.batching == "latency", lifo_after=cfg.lifo_after)
        self.max_batch = max_batch        # the batcher's cap when the plane does not lower it
        self.credit = cfg.credit or min(max(2 * max_batch, 2), P.MAX_CREDIT)
        self.host = P.local_host_id()
        self.pid = _SERVING_PID[0] = os.getpid()
        self.cuda = self.device.startswith("cuda")
        self.plane: DataPlane = self._open_plane()
        self.transports = self.plane.transports
        self.ctx = ctx or zmq.Context.instance()
        _own_endpoint(cfg.broker)
        self.upstream = upstream if upstream is not None else BrokerLink(
            cfg.broker, self.ctx, server_key=cfg.server_key, worker_key=cfg.worker_key, insecure=cfg.insecure)
        self.sock: zmq.Socket | None = None   # the upstream socket the loop polls (while serving)
        self.jobs: dict[bytes, Job] = {}      # envelope -> job, while pending in the batcher
        self.running: dict[bytes, Job] = {}   # envelope -> job, while its batch (or stream) runs
        # What the heartbeat thread read while a batch computed on the loop's thread
        # (`_read_while_computing`), for the loop to handle right after, in order: messages
        # with their arrival times, the envelopes of the REQUESTs among them, and the
        # envelopes it already gave back to a RECALL.
        self._stash: list = []
        self._stash_requests: set[bytes] = set()
        self._returned_early: set[bytes] = set()
        self._stash_direct: list = []         # ... and what it read on the direct socket: (frames, arrival time)
        self._lease_lost: set[bytes] = set()  # leased requests running when their lease ended (`_fail_pending`)
        self._direct_judged = 0               # its first entry read while the batch looked short (re-judged)
        # Leased requests waiting in the batcher that the heartbeat thread answered 429
        # while the batch became long (`_bounce_queued`): the loop drops them right after.
        self._bounced_early: set[bytes] = set()
        # The batch (or stream) running now, for the head-of-line rule of leases
        # (docs/protocol.md section 10.3): when it started (monotonic) and its predicted
        # seconds (None: unknown); whether the broker was told BUSY for it.
        self._batch_at: float | None = None
        self._batch_predicted: float | None = None
        self._busy_told = False
        self.returned = 0                     # requests given back unstarted (RECALL)
        # What only the worker sees, for the broker's metrics (a STATS message each
        # heartbeat interval with something new: `_send_stats`); seconds, and batch sizes.
        # Leased requests (their FINALs never cross the broker) add their outcomes and their
        # time from our receipt to the FINAL sent (`_count_leased`).
        self._hist = {"compute": Histogram(LATENCY_BUCKETS), "input": Histogram(LATENCY_BUCKETS),
                      "output": Histogram(LATENCY_BUCKETS), "batch": Histogram(BATCH_BUCKETS),
                      "leased_request": Histogram(LATENCY_BUCKETS)}
        self._leased_outcomes: dict[int, int] = {}  # outcome code (0: a result) -> FINALs since the last STATS
        # When the first of them came: a STATS goes out LEASED_STATS_S after it, not at the
        # next housekeeping (a heartbeat interval): a worker that dies takes with it only the
        # counts of its last moments (the metrics hunt: 10 pinned requests of the second
        # before a SIGKILL were in no count).
        self._leased_since: float | None = None
        self._leased_dropped = 0  # frames leased latest-wins streams dropped, since the last STATS
        self._stats_warm = 0     # keep-warm runs already reported
        self._stats_usage = None  # pool use last reported
        self.counts = False        # the broker counts (its WELCOME said so): STATS, histograms
        self._max_reply_frame: int | None = None  # the largest reply frame our broker reads (its WELCOME)
        self.registered = False    # a WELCOME since the last (re)connect (see `ready`)
        self._plain_broker = False  # no WELCOME came within the wait: a plain MDP broker, or none
        self.last_loop = time.monotonic()  # the loop's last pass (the health endpoint's liveness)
        self.cancelled_running = 0            # requests cancelled while their batch ran
        # attested client (pid, start) -> whether it reads our CLOCK_MONOTONIC (`_admit`: deadline_at)
        self._clock_peers = ClockPeers()
        self.stop = threading.Event()
        self.hurry = threading.Event()  # stop without waiting for clients to release outputs
        # SIGTERM/SIGINT received (install_sigterm_drain): the handler only counts, with no
        # lock, since a signal may interrupt another handler or the loop inside an Event;
        # the loop turns the count into `stop` (1) and `hurry` (2) (`_take_signals`).
        self.signals = 0
        self._stopping_told = False  # STOPPING sent (`_tell_stopping`)
        self._broker_stops = False  # our broker's WELCOME said it takes STOPPING
        # A pipe the signal handlers write to (`signal.set_wakeup_fd`), watched by the loop:
        # a SIGTERM to an idle worker starts its drain now, not at its next wake-up (up to
        # a heartbeat interval later, while its readiness probe still said 200).
        self.signal_fd: int | None = None
        self.served = 0
        self.compute_times = ComputeTimes(cfg.heartbeat_interval)
        # Liveness settings: the command line's until the broker's WELCOME replaces them.
        self.heartbeat_interval = cfg.heartbeat_interval
        self.heartbeat_liveness = cfg.heartbeat_liveness
        self.broker_instance: bytes | None = None
        self._direct_ok = False  # direct replies: once a broker WELCOMEd us (and --no-direct-reply not given)
        self._offload: ComputeThread | None = None
        self._poller: Waiter | None = None      # the loop's, while it serves
        self._events: list = []                 # what its last wait found ready
        self._monitor_fd: int | None = None     # the upstream monitor's descriptor, in that waiter
        self._heartbeats: LoopHeartbeats | None = None  # while serving
        self._busy = False
        self._ready_cb = None         # serve's ready callback until it has run (once)
        self._ready_deadline = 0.0    # when it runs without a WELCOME
        self._ready_wait = 0.0
        self._serving_since = 0.0     # when serve began (whether the fallback heard a word since)
        self._reconnect_why: str | None = None  # set by a DISCONNECT; the loop reconnects
        self.refused: str | None = None  # the broker's reason for refusing our READY: we stop
        self._last_heard = 0.0
        self._heard_at = -math.inf  # when a message from the broker was last read (readiness, plain MDP)
        # Over tcp, bytes of the broker's on their way count as its word (a large request on
        # a slow link holds its heartbeats back: wire.TcpWatch).
        self._tcp = TcpWatch() if self.cfg.broker.startswith("tcp://") else None
        self._service_b = self.service.encode()
        self.tracing = tracing if tracing is not None else tracing_from_env(self.service)
        self._streaming = bool(getattr(self.model, "streaming", False))
        self._signature = parse_inputs(getattr(self.model, "inputs", None), "inputs")
        self._outputs = parse_inputs(getattr(self.model, "outputs", None), "outputs")
        # Direct reply: one PUSH socket per client reply_to endpoint; the envelopes of the
        # FINALs sent that way, gathered into DONEs for the broker.
        self.direct = DirectSockets(self.ctx, capacity=cfg.direct_sockets if cfg.direct_sockets is not None
                                    else reply_sockets(), holders=getattr(self.plane, "holders", None))
        self.dones = DoneGather(delay=cfg.done_delay, max_pending=max(1, cfg.done_batch or self.credit // 4))
        self.dones.info = False  # until a WELCOME asks for outcomes (`metrics` or `outcomes`)
        # While a batch's replies are written: its header-only FINALs per reply_to, sent as
        # one FINALS message per client when the batch is done (None: send each at once).
        self.batch_finals: BatchFinals | None = None
        self.direct_sent = 0
        self.stale_replies = 0  # replies not written: their broker connection had been replaced
        # Leases (--direct): the table and the direct socket (bound last, below); None when off.
        self.leases: LeaseTable | None = None
        self.direct_socket: DirectSocket | None = None
        self._fd_guard: Headroom | None = None  # an ipc direct socket's, near the descriptor limit
        # Descriptors closed since the C heap was last trimmed (`_trim_after_closes`), and the trim's thread
        self._closes = ClosesSeen()
        self._burst = BurstSeen()  # inline tensors moved: a burst's memory trimmed once it is over
        self._trimming: threading.Thread | None = None
        self._direct_aside: str | None = None  # where its file is while moved aside
        self.leased_sent = 0          # FINALs sent on the direct socket
        # FINALs on the direct socket that met their connection's full queue (its client
        # alive, not reading): key -> (frames, job: None for a refusal), sent again until they
        # go, the connection is gone or the lease ends for a client presumed dead (`_send_held`).
        self._held: dict = {}
        self._held_seq = 0            # keys of held refusals (a job's is its envelope)
        self.leased_bounced = 0       # leased REQUESTs sent back to the broker's path (429): they would wait behind another's long batch
        self._lease_seq = 0           # the worker's own keys for leased requests
        self._linger_until = 0.0      # when stopping with leases: answer direct REQUESTs (503) until then
        self._bad_direct = P.RateLimitedLog(log)
        # The lone-request lane (`_lone_ready`): on while `serve` loops (tests that drive
        # the loop's steps one by one turn it on themselves).
        self.lone_lane = False
        self._lane_ran = False  # a batch ran in the lane during the current drain
        if cfg.warmup:
            try:
                self._warmup()
            except BaseException as e:
                end_forked_child(e)
                if not isinstance(e, Exception):
                    raise
                raise WarmupError(raised(e)) from e  # the model's own error, on its own example inputs
            end_forked_child()
        # Keep-warm (docs/gpu.md): a batch of one of the example inputs while idle.
        self.keep_warm = self._open_keep_warm()
        if cfg.direct:
            try:
                self.direct_socket = DirectSocket(self.ctx, link=cfg.direct_link, tcp=cfg.direct_tcp,
                                                  curve=self._direct_keys(),  # DirectSocketError: says why
                                                  heartbeat_s=cfg.heartbeat_interval,
                                                  link_conns=max(LINK_CONNS, 2 * self.credit))
            except Exception:
                self.plane.close()
                raise
            self.leases = LeaseTable()
            _own_endpoint(self.direct_socket.endpoint)
            if self.direct_socket.link is not None:
                _own_endpoint(self.direct_socket.link.path)
            if not self.direct_socket.tcp:
                self._fd_guard = Headroom(nofile_limit())  # (_watch_descriptors)

    def _direct_keys(self) -> tuple[bytes, bytes] | None:
        """The CurveZMQ key pair of a tcp direct socket: the worker's own (``worker_key``,
        the certificate it is known to the broker by); None on ipc, or plain tcp
        (``insecure``)."""
        cfg = self.cfg
        if cfg.direct_tcp is None or cfg.insecure:
            return None
        if cfg.worker_key is None:
            raise DirectSocketError(f"--direct-tcp {cfg.direct_tcp}: a tcp direct socket is a CurveZMQ server; give "
                                    "this worker its key pair (--worker-key NAME.key_secret), or --insecure for plain "
                                    "tcp (docs/security.md)")
        from broker.protocol import curve as C

        try:
            return C.load_secret_cert(cfg.worker_key, "worker key")
        except C.CurveKeyError as e:
            raise DirectSocketError(f"--direct-tcp: {e}") from None

    def _open_plane(self) -> DataPlane:
        """The data plane, chosen once: everything CUDA exists only on a CUDA worker, so the
        CPU path pays nothing for it."""
        cfg = self.cfg
        why = ring_too_large(cfg.out_capacity, memory_limit())
        if why is not None:
            log.warning("%s", why)
        host = HostPlane(self.backend, host=self.host, transports=cfg.transports,
                         out_capacity=cfg.out_capacity, out_slots=cfg.out_slots)
        if not self.cuda:
            return host
        from gpu_worker.cuda_plane import CudaPlane

        return CudaPlane.open(host, self.model, device=self.device, max_batch=self.max_batch,
                              pool_capacity=cfg.cuda_pool_capacity, pool_slots=cfg.cuda_pool_slots)

    # ------------------------------------------------------------------ lifecycle

    def _warmup(self) -> None:
        from gpu_worker.backends import warmup

        why = self._examples_misfit()
        if why is not None:
            # (they warmed it up and kept it warm on inputs its own service refuses with 422)
            raise ValueError(f"they do not fit its declared inputs: {why}")
        t0 = time.perf_counter()
        sizes = sorted({1, self.batcher.max_batch})
        if not warmup(self.backend, self.model, sizes):  # lazy init: allocator, kernels, CUDA context
            # No example inputs: nothing ran (it was logged as a warm-up of 0.0 ms).
            log.info("warm-up of %s skipped: the model has no example_inputs()", self.model.name)
            return
        self.compute_times.seed(warmup(self.backend, self.model, sizes))  # steady-state times
        self._set_margin()
        log.info("warm-up of %s on %s took %.1f ms", self.model.name, self.device, (time.perf_counter() - t0) * 1e3)

    def _examples_misfit(self) -> str | None:
        """Why the model's example inputs do not fit its declared `inputs`, or None (they
        do, or either is missing)."""
        if self._signature is None:
            return None
        try:
            example = self.model.example_inputs()
        except NotImplementedError:
            return None
        if not isinstance(example, Mapping):
            return None
        import numpy as np

        seen = []
        for name, v in example.items():
            a = np.asarray(v) if type(v).__module__.split(".")[0] != "torch" else v.detach().cpu().numpy()
            seen.append(_Seen(name, a.dtype.str, a.shape))
        return mismatch(self._signature, seen)

    def _set_margin(self) -> None:
        """The batcher refuses to run a request with less time left than the quickest
        recent batch took, while other work competes for the worker (gpu_worker/batching.py,
        "Deadlines").  Not for a streaming model: a stream's time is not a batch's."""
        if not self._streaming:
            self.batcher.deadline_margin = self.compute_times.floor()

    def _connect(self) -> None:
        caps = P.Ready(
            credit=self.credit,
            max_batch=self.batcher.max_batch,
            host=self.host,
            transports=list(self.transports),
            pid=self.pid,
            welcome=True,
            recall=True,
            direct=None if self.direct_socket is None else self.direct_socket.endpoint,
            link=None if self.direct_socket is None or self.direct_socket.link is None else self.direct_socket.link.path,
            direct_key=None if self.direct_socket is None or self.direct_socket.public_key is None
            else self.direct_socket.public_key.decode(),
            inputs=wire_signature(self._signature),
            outputs=wire_signature(self._outputs),
        )
        self.sock = self.upstream.connect(self.service, caps)
        self._last_heard = time.monotonic()

    def close(self) -> None:
        self._log_keep_warm()
        self.direct.close()
        if self.direct_socket is not None:
            if self._direct_aside is not None:  # its file, moved aside (_watch_descriptors)
                try:
                    os.unlink(self._direct_aside)
                except OSError:
                    pass
            self.direct_socket.close(DIRECT_LINGER_MS)  # replies and 503s already queued still leave
            self.direct_socket = None
        self.upstream.close()
        self.sock = None
        self.plane.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def serve(self, ready_cb=None) -> None:
        """Run until `self.stop` is set; then drain what is held and DISCONNECT."""
        self._connect()
        self._offload = ComputeThread(self.ctx, self._run_model)
        self._heartbeats = LoopHeartbeats(lambda: self._send(P.worker_heartbeat()),
                                          lambda: self.upstream.last_sent, self.heartbeat_interval,
                                          during=self._read_while_computing)
        # READY means registered: `ready_cb` runs on the first WELCOME (the broker has us),
        # or, from a broker that never sends one (plain MDP), after READY_FALLBACK_INTERVALS
        # heartbeat intervals without it.  Once only: a WELCOME after a reconnect is silent.
        self._ready_cb = ready_cb
        # (an upstream that is a relay by design, `relay`: nobody will ever speak, so ready at
        # once and without the warning; bench.proxied_worker's waited 2 s and warned each start)
        relay = getattr(self.upstream, "relay", False)
        self._ready_wait = 0.0 if relay else READY_FALLBACK_INTERVALS * self.heartbeat_interval
        self._serving_since = time.monotonic()
        self._ready_deadline = self._serving_since + self._ready_wait
        upstream = self.upstream
        # Waited for by descriptor (wire.Waiter: EVENTS asked only of sockets that may have
        # changed).  The offload thread's completion socket is watched only while a batch is
        # offloaded (_run adds it).
        poller = self._poller = Waiter()
        try:
            poller.add(self.sock)
            self._watch_monitor(poller)
            direct = None if self.direct_socket is None else self.direct_socket.sock
            if direct is not None:
                poller.add(direct)
            link_fd = -1
            link = None if self.direct_socket is None else self.direct_socket.link
            if link is not None:
                link_fd = link.fileno()
                poller.add_fd(link_fd)
            sig_fd = self.signal_fd
            if sig_fd is not None:
                poller.add_fd(sig_fd)
            next_housekeeping = time.monotonic() + self.heartbeat_interval
            self.lone_lane = True
            looked = time.monotonic()  # the last wait's end (`_resumed`)
            while not self._take_signals():
                # Read each pass: a WELCOME may have brought the broker's settings.
                interval = self.heartbeat_interval
                dead_after = interval * self.heartbeat_liveness
                now = time.monotonic()
                wake = None if self._busy else self.batcher.wake_at(now)
                timeout = interval if wake is None else max(0.0, min(interval, wake - now))
                timeout = self._keep_warm_timeout(now, timeout)
                if self._ready_cb is not None:
                    timeout = max(0.0, min(timeout, self._ready_deadline - now))
                ms = timeout * 1000.0
                done_ms = self.dones.wait_ms(now)
                if done_ms is not None:
                    ms = min(ms, done_ms)
                if self._leased_since is not None and self._stats_open():
                    ms = min(ms, max(0.0, (self._leased_since + LEASED_STATS_S - now) * 1000.0))
                if link is not None and link.inbox:
                    ms = 0  # read from the link already, not yet handled: its descriptor will not tell
                if self._reconnect_why is not None:
                    ms = 0  # learnt outside the wait (a stream, a batch): reconnect at once
                if self._held:  # FINALs for clients not reading: tried again each pass
                    self._send_held()
                    if self._held:
                        ms = min(ms, HELD_RETRY_S * 1000.0)
                events = self._events = poller.wait(ms)
                # Later than the wait allowed: this process did not run (`_resumed`); the
                # pass's own work since the last look counts too.
                woke = time.monotonic()
                if woke - looked - ms / 1000.0 > min(PAUSED_S, dead_after / 4):
                    self._resumed(woke - looked - ms / 1000.0, woke)
                looked = woke
                if sig_fd is not None and sig_fd in events:
                    logs.drain_pipe(sig_fd)  # the handler counted it; `_take_signals` acts on it
                if self._busy and self._offload.done in events:
                    self._finish_offloaded()
                if self.sock in events:
                    self._drain(ready=True)
                    self._last_heard = time.monotonic()
                if direct in events or link_fd in events or (link is not None and link.inbox):
                    self._drain_direct(router=direct in events, link=True)
                if self._busy and self.leases is not None and self.jobs:
                    self._bounce_pending()  # an offloaded batch that runs past its prediction
                if self._monitor_fd in events and upstream.reconnected():
                    log.info("the broker connection came back; registering again")
                    self._reconnect_why = "broker connection re-established"
                if self._reconnect_why is not None:
                    self._reconnect(poller)
                if not self._busy:
                    self.run_ready_batches()
                now = time.monotonic()
                if self._ready_cb is not None and now >= self._ready_deadline:
                    if relay:
                        pass
                    elif self._heard_at >= self._serving_since:
                        log.warning("no WELCOME from the broker within %.3g s (a plain MDP broker); "
                                    "announcing READY anyway", self._ready_wait)
                    else:
                        # A plain MDP broker heartbeats its workers; nothing at all is a relay
                        # that speaks only when a request comes (zmq.proxy), or no broker's
                        # backend (its frontend, another program, nobody).  READY all the
                        # same (a relay's workers need it), with the likely mistake said; the
                        # probe stays 503 until a word comes (`ready`).
                        why = ipc_problem(self.cfg.broker, "this worker")
                        refused = getattr(upstream, "refused", None)
                        if refused is not None:
                            # The handshake failed, which says more than any guess at the
                            # endpoint: the worker's keys (or --insecure) against the broker's.
                            why = (f"this worker's handshake with it failed ({refused}): check --server-key, "
                                   f"--worker-key (in the broker's --worker-keys?) or --insecure against how the "
                                   f"broker was started")
                        log.warning("nothing heard from %s within %.3g s, no WELCOME and no heartbeat: announcing "
                                    "READY anyway; %s", self.cfg.broker, self._ready_wait,
                                    why if why is not None else "if this is not a relay, is it the broker's backend "
                                    "endpoint (not its frontend)?")
                    self._plain_broker = True  # ready (the probe's) while connected and heard, from now on
                    self._announce_ready()
                if self.dones.ready(now):
                    self._flush_done()
                if self._leased_since is not None and now - self._leased_since >= LEASED_STATS_S:
                    self._send_stats()
                if now - upstream.last_sent >= interval:
                    self._send(P.worker_heartbeat())
                self._maybe_keep_warm()
                if now >= next_housekeeping:  # every interval, busy or not
                    self._watch_descriptors()
                    self._trim_after_closes()
                    self.plane.housekeeping()
                    self.direct.sweep()  # reply_to sockets of clients that exited
                    if link is not None:
                        link.expire(now)  # connections retired for a client that stopped reading
                    self._send_stats()
                    next_housekeeping = now + interval
                self.last_loop = now
                if self._tcp is not None and now - self._last_heard > interval:
                    self._last_heard = max(self._last_heard, self._tcp.look(now))  # a message still crossing
                # Messages waiting in the socket (a long batch just ended) are not silence.
                if (upstream.watch_liveness and now - self._last_heard > dead_after
                        and not sock_events(self.sock) & _POLLIN):
                    # The kernel's word on an ipc endpoint: a broker started again on another
                    # backend left this worker saying only "silent" once a minute.
                    why = ipc_problem(self.cfg.broker, "this worker")
                    refused = getattr(upstream, "refused", None)
                    if refused is not None:
                        why = f"its handshake failed: {refused}"
                    self._silence_log.warning("broker silent for %.1f s; reconnecting%s", now - self._last_heard,
                                              "" if why is None else f" ({why})")
                    self._reconnect_why = "broker connection lost"
                    self._reconnect(poller)
            # Drain: the leases end first (no new direct request runs), what the broker and
            # the leases already handed us is finished, then we say goodbye.
            if sig_fd is not None:
                poller.remove(sig_fd)  # a second signal is read by the waits that follow
            self.lone_lane = False
            self._tell_stopping()
            self._end_leases()
            self._drain()
            self._drain_direct()
            while self._busy or len(self.batcher):
                if self._busy:
                    if self._wait_offloaded(self.heartbeat_interval):
                        self._finish_offloaded()
                    else:
                        self._send(P.worker_heartbeat())
                    continue
                self.run_ready_batches(force=True)
            self._flush_done()
            self._send_stats()  # the last interval's counts and leased outcomes, before the goodbye
            self._send(P.worker_disconnect())
            self._linger_direct()
            self._wait_outputs_released()
        finally:
            poller.close()  # first: wire's marks let go of the sockets whatever follows
            self._poller = None
            self._heartbeats.close()
            self._offload.close()

    def _wait_outputs_released(self) -> None:
        """Keep the output memory (unlinked by close) until every client released what it was
        sent, its holder died, `cfg.drain_grace` passed, or `hurry` was set (a second SIGTERM).
        Nothing else is left to do: the broker was told DISCONNECT, so no request comes."""
        grace = self.cfg.drain_grace
        t0 = time.monotonic()
        lent = self.plane.lent()
        if lent:
            log.info("keeping %d outputs readable until their clients release them (at most %.0f s)", lent, grace)
        while lent and not (self._take_signals() and self.hurry.is_set()):
            if time.monotonic() - t0 >= grace:
                log.warning("%d outputs still unreleased by clients after %.1f s; closing anyway", lent, grace)
                return
            # Released slots change in shared memory, with no message: look every 10 ms.
            if self.direct_socket is None:
                self.hurry.wait(0.01)
            else:
                self._wait_direct(0.01)
            lent = self.plane.lent()
        if lent == 0 and time.monotonic() - t0 > 0.05:
            log.info("outputs released by their clients after %.2f s", time.monotonic() - t0)

    def _send(self, frames) -> None:
        self.upstream.send(frames)

    def _take_signals(self) -> bool:
        """Turn the signals counted by the handler into `stop` and `hurry` (on the loop's
        thread, outside any handler); whether `stop` is set."""
        n = self.signals
        if n:
            if not self.stop.is_set():
                self.stop.set()
            if n >= 2 and not self.hurry.is_set():
                self.hurry.set()
        return self.stop.is_set()

    # ------------------------------------------------------------------ receiving

    def _reconnect(self, poller: Waiter) -> None:
        """Drop what the old connection held and register afresh.  Only the loop calls this,
        between drains: the socket being read must never be closed under its reader."""
        why, self._reconnect_why = self._reconnect_why, None
        if self._tcp is not None:
            self._tcp.use(-1)  # the new connection is learned from its first message
        if self.broker_instance is not None:
            self.registered = False  # our broker: until its next WELCOME (a plain one sends none)
        # Direct replies, too, until the next WELCOME (the broker may be a plain one now);
        # the jobs running across this reconnect still answer their clients directly (stale).
        self._direct_ok = False
        self._busy_told = False  # the new connection's broker was told nothing (no BUSY off for it)
        poller.remove(self.sock)
        if self._monitor_fd is not None:
            poller.remove(self._monitor_fd)
            self._monitor_fd = None
        self._fail_pending(why)
        self._connect()
        poller.add(self.sock)
        self._watch_monitor(poller)

    def _watch_monitor(self, poller: Waiter) -> None:
        """Wait for the upstream's connection monitor by its file descriptor alone, never
        asking its EVENTS.  That is safe because nothing but `reconnected()` touches the
        monitor, and it reads until the socket says nothing is left, so the descriptor
        signals again when the next event arrives; read once now, for the same reason."""
        monitor = self.upstream.monitor
        if monitor is None:
            return
        self._monitor_fd = monitor.get(zmq.FD)
        poller.add_fd(self._monitor_fd)
        if self.upstream.reconnected() and self._reconnect_why is None:
            self._reconnect_why = "broker connection re-established"

    def _drain(self, ready: bool = False) -> None:
        # EVENTS instead of recv(NOBLOCK) + zmq.Again: no exception per wake-up.  A message
        # that asks for a reconnect ends the drain: the loop reconnects before reading again.
        # ``ready``: the Waiter has just found a message here (it asked EVENTS, and nothing
        # touched the socket since), so the first read needs no question.
        sock = self.sock
        self._lane_ran = False
        # After a batch run in the lane the loop's turn comes first (signals, the other
        # socket, DONEs, housekeeping): what else waits here is read on its next pass.
        tcp = self._tcp
        while self._reconnect_why is None and not self._lane_ran and (ready or sock_events(sock) & _POLLIN):
            ready = False
            try:
                frames = recv_frames(sock, zmq.NOBLOCK)  # never waits, whatever read it meanwhile
            except zmq.Again:
                break
            self._last_heard = self._heard_at = time.monotonic()
            if tcp is not None:
                tcp.note(frames[0])  # the connection the broker's word comes on
            try:
                self.on_message(frames)
            except Exception:
                self._oops.exception("unexpected error while handling a message from the broker; dropped it")

    def on_message(self, frames) -> None:
        """Handle one message from upstream (what the loop does with each one it receives)."""
        msg = self.upstream.receive(frames)
        if msg is not None:
            if msg.command == P.W_REQUEST and log.isEnabledFor(logging.DEBUG):
                name, fields = _priority_name(msg.body)
                log.debug("read a request from the broker (priority %s)", name, extra=fields)
            self._handle(msg, time.monotonic())

    def _handle(self, msg: P.BrokerToWorker, received: float) -> None:
        cmd = msg.command
        if cmd == P.W_REQUEST:
            self._on_request(msg.envelope, msg.body, received)
        elif cmd == P.W_CANCEL:
            why = msg.body[0] if msg.body else 0
            self._cancel(msg.envelope, why == P.CANCEL_EXPIRED, why == P.CANCEL_CLIENT_GONE)
        elif cmd == P.W_RECALL:
            self._on_recall(msg.body)
        elif cmd == P.W_WELCOME:
            self._on_welcome(msg.body[0])
        elif cmd == P.W_DISCONNECT:
            why = _refusal(msg.body)
            if why is not None:
                # Our READY was refused (a credit or a service name the broker does not
                # take): registering again would be refused again, forever.
                log.error("the broker refused this worker: %s", why)
                self.refused = why
                self.stop.set()
                return
            log.info("broker asked us to reconnect")
            self._reconnect_why = "broker restarted"
        elif cmd == P.W_LEASE:
            self._on_lease(msg.body[0])
        elif cmd == P.W_LEASE_END:
            self._on_lease_end(msg.body[0])

    def _cancel(self, envelope: bytes, expired: bool = False, gone: bool = False) -> None:
        """CANCEL (from the broker, which says why when it is not the client's asking: the
        deadline passed, ``expired``, or the client left, ``gone``; or on the direct socket
        for a leased request, which says whether its caller's deadline had passed)."""
        how = _EXPIRED if expired else _GONE if gone else True
        job = self.jobs.get(envelope)
        if job is not None:
            dropped = self.batcher.drop(lambda p: p.item is job)
            if how is _EXPIRED and dropped:  # lost to its deadline while it waited here
                self.batcher.lost(dropped[0].key, time.monotonic())
            del self.jobs[envelope]
            self._cancelled(job, how, "before it ran")
            return
        job = self.running.get(envelope)
        if job is not None and not job.cancelled:
            # Running: a streaming model stops at its next partial; a batch cannot be
            # interrupted, so its result for this request is dropped (_reply_batch).
            job.cancelled = how
            self.cancelled_running += 1

    def _cancelled(self, job: Job, how, when: str) -> None:
        """Answer a cancelled request (``how``: `Job.cancelled`'s value): 499, or, cancelled
        because its caller's deadline passed, DEADLINE_EXCEEDED (a leased request is counted
        by its answer's code: `_count_leased`)."""
        if how is _EXPIRED:
            self._reply_error(job, P.ErrorCode.DEADLINE_EXCEEDED, f"deadline passed {when}; its caller gave up")
        elif how is _GONE:
            self._reply_error(job, P.ErrorCode.CANCELLED, f"cancelled {when}: its client left")
        else:
            self._reply_error(job, P.ErrorCode.CANCELLED, f"cancelled by the client {when}")

    def _on_welcome(self, w: P.Welcome) -> None:
        """Registered with broker process `w.instance`, which sets the liveness settings."""
        self.broker_instance = w.instance
        # Replies may go straight to their clients from now on (and DONEs tell the broker):
        # a broker that WELCOMEs knows DONE; a plain MDP broker would hold this worker busy
        # for good after its first direct reply (the version-skew hunt).  Off again at a
        # reconnect until the next WELCOME (`_reconnect`; a batch running across it still
        # answers its clients directly: `job.stale`).
        self._direct_ok = self.cfg.direct_reply
        self.registered = True
        self._plain_broker = False  # ours after all (a READY announced before it came): WELCOMEs rule
        self.counts = bool(w.metrics)
        self._max_reply_frame = w.max_reply_frame  # (`_reply_tensors`)
        # Outcomes in the DONEs for a counting broker, and for one whose congestion rule
        # reads the deadlines we miss (our 504s: broker/state.py, "Congestion").
        self.dones.info = bool(w.metrics or w.outcomes)
        # A new registration (a restarted broker, or a reconnect after a stall) knows none of
        # the pools' gauges: the next STATS carries them, changed or not (the metrics hunt:
        # they were missing from a restarted broker until traffic moved them).
        self._stats_usage = None
        self._broker_stops = bool(w.stopping)  # it takes STOPPING (`_tell_stopping`)
        self._silence_log.last = -math.inf  # heard again: its next silence is a line at once
        if (w.heartbeat_interval, w.heartbeat_liveness) != (self.heartbeat_interval, self.heartbeat_liveness):
            log.info("the broker sets liveness: heartbeat every %.3g s, presumed dead after %d silent intervals "
                     "(was %.3g s x %d)", w.heartbeat_interval, w.heartbeat_liveness,
                     self.heartbeat_interval, self.heartbeat_liveness)
        self.heartbeat_interval = w.heartbeat_interval
        self.heartbeat_liveness = w.heartbeat_liveness
        self.compute_times.heartbeat_interval = w.heartbeat_interval
        if self._heartbeats is not None:
            self._heartbeats.interval = w.heartbeat_interval
        log.info("registered with broker %s", w.instance.hex())
        self._announce_ready()

    def _announce_ready(self) -> None:
        """Run serve's `ready_cb` the first time only."""
        cb, self._ready_cb = self._ready_cb, None
        if cb is not None:
            cb()

    @property
    def ready(self) -> bool:
        """The health probe's ready: registered (a WELCOME since the last (re)connect), or,
        from a broker that sends no WELCOME (plain MDP: READY was announced after the wait),
        connected to it.  Never ready with no broker at all: announcing READY after the wait
        does not make a worker that nobody has registered.  Not while its connection is seen
        closed (the monitor's word): a broker that exited left its workers ready for their
        liveness window, 3 s at the defaults (the SLO audit)."""
        if self.registered:
            return bool(getattr(self.upstream, "connected", True))
        # A plain MDP broker heartbeats its workers: one heard from within the liveness
        # window.  A socket merely connected (to the broker's frontend by mistake, say)
        # answered 200 for good.
        return (self._plain_broker and bool(getattr(self.upstream, "connected", False))
                and time.monotonic() - self._heard_at <= self.heartbeat_interval * self.heartbeat_liveness)

    def _on_recall(self, envelopes) -> None:
        """The broker wants these back for an idle worker: give back the ones still waiting
        in the batcher; the others (started, or already answered) are kept and answer as
        usual.  Always answered, so the idle worker can look elsewhere at once."""
        back = [e for e in envelopes if e in self.jobs]
        kept = [e for e in envelopes if e not in self.jobs]
        if back:
            gone = set(back)
            for p in self.batcher.drop(lambda p: p.item.envelope in gone):
                self.plane.finish_reads(p.item)
            for e in back:
                del self.jobs[e]
            self.returned += len(back)
        self._send(P.worker_returned(back, kept))

    def _read_while_computing(self) -> tuple[int, list[int]]:
        """On the heartbeat thread, holding the socket, while a batch computes on the loop's
        thread (`compute.LoopHeartbeats`): read what has arrived, so that every request's
        wait is measured from its arrival and a RECALL is answered now, not after the batch.
        Everything but the RECALL is left for the loop (`_after_compute`); the loop thread
        does not touch `jobs` while it computes, so reading it here is safe.  The direct
        socket is read the same way (`_read_direct_while_computing`), and the broker is told
        BUSY once the batch runs long.  Returns how many messages of work it read (all but
        the broker's heartbeats) and the descriptors the thread may sleep on until its next
        look (the sockets drained, whose next message signals them: the upstream socket's,
        and the direct socket's and local link's unless their stash is full), none where the
        upstream socket may hold a message that will not signal."""
        drained, read = self._read_direct_while_computing()
        if self.signals and (not self._stopping_told or (self.leases is not None and not self.leases.stopping)):
            # SIGTERM during a long batch: the broker hears of it now, and so do the
            # leaseholders (LEASE_END, relayed by the broker): their next requests go through
            # the broker to another worker instead of waiting here for this batch, then the
            # drain (the idle hunt).  The loop is inside the model call and touches neither
            # the lease table nor the sockets meanwhile.
            self._tell_stopping()
            self._end_leases()
        if not self._busy_told and self._batch_at is not None:
            self._maybe_tell_busy(time.monotonic())
        sock = self.sock
        if sock is None or self._reconnect_why is not None:
            return read, []
        if self.dones.envelopes and self.dones.ready(time.monotonic()):
            # FINALs that went straight to their clients before this batch: the broker
            # settles them now, not after it (it counted them as still running, expired
            # them at their deadlines, and, had this worker stopped meanwhile, ran them
            # again elsewhere: the pause hunt).  The loop does not touch `dones` while it
            # computes.
            self._flush_done()
        while sock_events(sock) & _POLLIN:
            msg = self.upstream.receive(recv_frames(sock))
            if msg is None:
                continue
            if msg.command != P.W_HEARTBEAT:
                read += 1
            if msg.command == P.W_RECALL:
                early = self._returned_early
                back, kept = [], []
                for e in msg.body:
                    if (e in self.jobs or e in self._stash_requests) and e not in early:
                        back.append(e)
                    else:
                        kept.append(e)
                early.update(back)
                self.returned += len(back)
                self._send(P.worker_returned(back, kept))
                continue
            if msg.command == P.W_REQUEST:
                self._stash_requests.add(msg.envelope)
                if log.isEnabledFor(logging.DEBUG):  # when it reached this worker, not when the broker sent it
                    name, fields = _priority_name(msg.body)
                    log.debug("read a request from the broker while a batch computes (priority %s)", name,
                              extra=fields)
            self._stash.append((msg, time.monotonic()))
        fd = quiet_fd(sock)
        if fd is None:
            return read, []
        fds = [fd]
        ds = self.direct_socket
        if drained and ds is not None:
            fd = quiet_fd(ds.sock)
            if fd is not None:
                fds.append(fd)
            if ds.link is not None:
                fds.append(ds.link.fileno())  # level-triggered: readable while it has something to do
        return read, fds

    def _read_direct_while_computing(self) -> tuple[bool, int]:
        """On the heartbeat thread, holding the direct socket with the upstream one (the
        loop hands both over in `computing_begin` and takes them back in `computing_end`):
        stash what arrived with its arrival time, for `_after_compute`, so a leased
        request's wait is measured from its arrival and a CANCEL drops a running result
        before it is written.  A leased REQUEST that would wait behind this batch, long and
        another's, is sent back to the broker's path now (`_bounce_direct`), and so is one
        already waiting in the batcher (`_bounce_queued`); a HELLO is handled now (it only
        binds a connection in the lease table) unless its connection has messages stashed
        (it then keeps its place behind them).  At most `_DIRECT_STASH_MAX` messages are
        stashed; the rest stay in the socket for the loop.  Whether it read all there was
        (the socket and the link then signal their next message), and how many it read."""
        ds = self.direct_socket
        if ds is None:
            return True, 0
        stash = self._stash_direct
        at = self._batch_at
        if at is not None and runs_long(time.monotonic() - at, self._batch_predicted):
            now = time.monotonic()
            judged = self._direct_judged
            if judged < len(stash):
                # Read while the batch still looked short: it is long now.  (What was read
                # while it was long is not looked at again: its verdict stands.)
                stash[judged:] = [(frames, t) for frames, t in stash[judged:]
                                  if not (_is_direct_request(frames)
                                          and self._bounce_direct(bytes(frames[0]), frames[4:], now))]
                self._direct_judged = len(stash)
            if self.jobs:
                self._bounce_queued(now)
        most = _DIRECT_STASH_MAX - len(stash)  # a flood never starves the heartbeats
        read = 0
        while most > 0:
            frames = ds.next_message()
            if frames is None:
                return True, read
            read += 1
            now = time.monotonic()
            request = _is_direct_request(frames)
            if request:
                if self._bounce_direct(bytes(frames[0]), frames[4:], now):
                    continue
            elif len(frames) >= 3 and bytes(frames[1]) == P.MDPC and bytes(frames[2]) == P.C_HELLO:
                # Bound now (the lease table is the loop's only outside compute, and a HELLO
                # touches nothing else), so the REQUEST that often follows at once is judged
                # with its lease; but never ahead of what its connection sent before it (a
                # stashed DISCONNECT replayed after it would unbind the new lease).
                route = bytes(frames[0])
                if not any(bytes(f[0]) == route for f, _ in stash):
                    self._on_direct_frames(frames, now)
                    continue
            if log.isEnabledFor(logging.DEBUG) and len(frames) >= 3:
                cmd = bytes(frames[2])
                if cmd in (P.C_REQUEST, P.C_CANCEL):
                    log.debug("read a %s on the direct socket while a batch computes",
                              "REQUEST" if cmd == P.C_REQUEST else "CANCEL")
            most -= 1
            stash.append((frames, now))
            # Its verdict stands unless it is a REQUEST read while the batch looked short.
            if self._direct_judged == len(stash) - 1 and (
                    not request or (at is not None and runs_long(now - at, self._batch_predicted))):
                self._direct_judged += 1
        return False, read

    def _bounce_queued(self, now: float) -> None:
        """On the heartbeat thread during compute (`_read_direct_while_computing`), once the
        running batch is long: the leased requests waiting in the batcher whose lease has
        none in it are answered 429 now, as `_bounce_pending` would, and noted in
        `_bounced_early`; the loop drops them from the batcher and frees their reads and
        slots right after the batch (`_after_compute`).  Only reads the loop's state (`jobs`,
        the lease table, `running`): the loop is inside the model call and touches none of it."""
        leases = self.leases
        if leases is None or leases.stopping:
            return
        gone = self._bounced_early
        for key, job in list(self.jobs.items()):
            if job.route is None or key in gone:
                continue
            ran_ms = self._waits_behind_another(leases.lease_of(job.route), now)
            if ran_ms is None:
                continue
            gone.add(key)
            self.leased_bounced += 1
            self._direct_send(job.route, P.error_body(
                job.req.id, P.ErrorCode.QUEUE_FULL,
                f"this worker is running another's batch ({ran_ms:.0f} ms so far) and would start "
                "this request only after it; send this one through the broker, which can start it on an idle "
                "worker (it did not run)"))

    def _after_compute(self) -> None:
        """Right after a batch computed on the loop's thread: handle what the heartbeat
        thread read meanwhile, from the broker and on the direct socket, in the order it was
        read, less what it gave back."""
        if not self._stash and not self._returned_early and not self._stash_direct and not self._bounced_early:
            return
        direct, self._stash_direct = self._stash_direct, []
        self._direct_judged = 0
        bounced, self._bounced_early = self._bounced_early, set()
        if bounced:
            # Answered 429 by the heartbeat thread meanwhile (`_bounce_queued`): they never run.
            for p in self.batcher.drop(lambda p: p.item.envelope in bounced):
                job = self.jobs.pop(p.item.envelope)
                self.plane.finish_reads(job)
                self.leases.finish(job.envelope)
        stash, self._stash = self._stash, []
        early, self._returned_early = self._returned_early, set()
        self._stash_requests = set()
        if early:
            for p in self.batcher.drop(lambda p: p.item.envelope in early):
                self.jobs.pop(p.item.envelope, None)
                self.plane.finish_reads(p.item)
        # One sequence, by arrival (each stash is in arrival order already; the broker's
        # message first at a tie).  When the broker's messages were all handled first, a
        # LEASE_END read late in a long batch was handled before the leased REQUESTs read
        # early in it: they were refused as if sent after the end (503, resend through the
        # broker), which counts nothing, so those of a dead client were counted nowhere
        # (the gone hunt).
        if stash and direct:
            todo = heapq.merge(((t, m, None) for m, t in stash), ((t, None, f) for f, t in direct), key=_arrival)
        elif stash:
            todo = ((t, m, None) for m, t in stash)
        else:
            todo = ((t, None, f) for f, t in direct)
        for received, msg, frames in todo:
            if msg is None:
                self._on_direct_frames(frames, received)
                continue
            if msg.command == P.W_REQUEST and msg.envelope in early:
                continue  # given back before we ever looked at it
            try:
                self._handle(msg, received)
            except Exception:
                self._oops.exception("unexpected error while handling a message from the broker; dropped it")
        if stash:
            self._last_heard = time.monotonic()

    def _on_request(self, envelope: bytes, body: tuple, now: float | None = None) -> None:
        if now is None:
            now = time.monotonic()
        if not body or not P.is_header(body[0]):
            job = Job(envelope, None, None, body, now, None, None)
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
            req = P.decode_request(body[0], frames=rest, brokered=True)
        except P.ProtocolError as e:
            # The id the header names, if any can be read, so the client can match the 400.
            job = Job(envelope, P.Request(id=P.lenient_request_id(body[0])), None, None, now, None, None)
            self._reply_error(job, e.code, str(e))
            return
        if req.reply_to is not None:
            endpoint = direct_endpoint(True, req, host=self.host, enabled=self._direct_ok,
                                       streaming=self._streaming)
            if endpoint is not None:  # connect now, so that the connection is up by the reply
                self.direct.open(endpoint)  # (a reply sent before it is relayed: DirectSockets.open)
        self._admit(Job(envelope, req, None, None, now, None, None), rest, now)

    def _admit(self, job: Job, rest, now: float, principal=None) -> None:
        """A decoded request (brokered or leased): checked against the model, its inputs
        mapped, then into the batcher; or answered with the error that stops it.

        Its principal in the batcher, whose requests take turns with other principals'
        (gpu_worker/batching.py, "Turns"): the client the broker attested, as the broker
        counts it (broker/state.py, "Connections and principals"): its process, (``req.pid``,
        ``req.pid_start``), the broker's word, never the header's, else ``principal`` (a lease's, e.g. the
        CurveZMQ key of a tcp leaseholder), else None (the brokered requests of clients
        nobody could attest, tcp ones included, are one principal here)."""
        if rest:
            self._count_big(rest)
        req = job.req
        if self._signature is not None:
            why = mismatch(self._signature, req.tensors)
            if why is not None:
                self._reply_error(job, P.ErrorCode.INVALID_INPUT,
                                  f"{why}; service {self.service!r} takes {describe(self._signature)} (send "
                                  f"inputs that match it; the model did not run)")
                return
        shed = self.plane.admit()
        if shed is not None:
            self._reply_error(job, P.ErrorCode.QUEUE_FULL, shed)
            return
        try:
            t0 = time.perf_counter()
            self.plane.map_inputs(job, rest)
            job.input_ms = (time.perf_counter() - t0) * 1e3
        except OutOfResources as e:  # this worker's descriptors or memory, not the request's fault
            self._reply_error(job, P.ErrorCode.INTERNAL,
                              f"worker pid {os.getpid()} cannot map the request's inputs now ({e}): it is out of "
                              f"descriptors or memory; raise its RLIMIT_NOFILE, or retry")
            return
        except NotShared as e:
            # The sender runs as another user (or is not dumpable): the kernel keeps its
            # memory from this worker.  NOT_LOCAL, as for a worker on another host: the
            # client sends the same inputs again inline (docs/deploy.md, "Layout").
            self._reply_error(job, P.ErrorCode.NOT_LOCAL,
                              f"worker pid {os.getpid()} (uid {os.geteuid()}) cannot open the sender's shared "
                              f"memory ({e}); send the tensors inline, or run client and worker as one user")
            return
        except NotAttested as e:
            # The broker could not say which process sent it (a connection whose maker has
            # exited, or an older broker that had not attested it yet): its memory cannot be
            # read, but the same tensors inline can.  NOT_LOCAL, so that the client resends
            # them inline rather than failing the call.
            self._reply_error(job, P.ErrorCode.NOT_LOCAL, f"worker pid {os.getpid()} cannot read the inputs: {e}")
            return
        except SegmentGone as e:
            # Its own memory (the owner check passed), closed by its sender since it sent
            # the request: a client closing with requests queued (the AR hunt saw each
            # gateway shutdown counted as protocol errors).  Nobody reads the answer.
            self._reply_error(job, P.ErrorCode.CANCELLED,
                              f"cannot read inputs: {e}; taken as cancelled by its sender")
            return
        except Exception as e:  # a stale/forged reference fails this request only
            if isinstance(e, StaleDescriptor) and e.moved_on:
                # A slot of the sender's own memory (the owner check passed) that the sender
                # has freed since it sent the request: our client frees a call's inputs only
                # at its end, so this is a copy of a call already answered (a retry after its
                # worker died, which had answered straight to the client before its delayed
                # DONE told the broker; a client's resend after a broker restart whose old
                # copy answered first) or given up.  Nobody reads the answer: it is the
                # sender's, as a closed segment is, not a protocol error (chaos soaks saw each
                # such copy in the protocol_error rate).  A state or generation the slot never
                # had (forged, or sent unready) is the 400 below.
                self._reply_error(job, P.ErrorCode.CANCELLED,
                                  f"cannot read inputs: {e}; its sender freed them since it sent the request "
                                  f"(a copy of a call already answered, or given up): taken as cancelled by its sender")
            else:
                self._reply_error(job, P.ErrorCode.PROTOCOL_ERROR, f"cannot read inputs: {e}")
            return
        if req.timeout_ms is not None:
            job.deadline = now + req.timeout_ms / 1000.0
            at = req.deadline_at
            if (at is not None and at < job.deadline and req.pid is not None
                    and self._clock_peers.same(req.pid, req.pid_start)):
                # A client on our clock (its pid the kernel's word, through the broker): its
                # deadline as it is, not its budget again from our receipt, which came late
                # when this loop was stalled (a leased request read after its deadline ran
                # for a caller long gone, its CANCEL right behind it: the broker's rule, for
                # the requests no broker times: docs/protocol.md, the header table).
                job.deadline = at
            if req.timeout_ms <= 0 or job.deadline <= now:
                self._reply_error(job, P.ErrorCode.DEADLINE_EXCEEDED, "deadline passed before the worker got the request")
                return
        key = tuple([(t.name, t.dtype, tuple(t.shape)) for t in req.tensors])
        # When its time began: the broker's receipt (it queued there for queue_ms).
        since = job.received - req.queue_ms / 1e3 if req.queue_ms and req.queue_ms > 0 else None
        observed = False
        if req.pid is not None:
            principal = (req.pid, req.pid_start)  # the process (a reused pid is another's)
        if self._lone_ready():
            if self.batcher.goes_alone(key, now, req.backlog, job.deadline, since, principal):
                # The lone-request lane: what run_ready_batches would run right after this
                # drain, a batch of one, runs now, without the batcher's queue around it.
                self._lane_ran = True
                try:
                    # Its batch starts now, its inputs mapped, not at its receipt (``now``):
                    # its compute span began with its input span, and its batch_wait_ms left
                    # the mapping out (the batcher's batches count it).
                    self._run([job], time.monotonic())
                except Exception as e:
                    # As from run_ready_batches: a fault of the worker's own, not of this
                    # message, ends the loop (the drains would log it and go on with a
                    # batch half done).
                    raise LaneFault(raised(e)) from e
                if not self._busy:  # it ran here (not offloaded): as run_ready_batches after it
                    self.batcher.idle()
                return
            observed = True  # its arrival is counted
        try:
            cost = float(self.model.cost(job.inputs))
            if not cost >= 0:  # NaN (no bound compares with it) or negative
                raise ValueError(f"it returned {cost}")
        except Exception as e:
            # A cost it cannot say counts as the whole bound: the request runs alone, never
            # in a batch over --max-cost (taken as 1.0, a cost() that raised or said NaN let
            # batches of four times the bound through, and nothing said so: the models audit).
            bounded = self.batcher.max_cost < math.inf
            cost = self.batcher.max_cost if bounded else 1.0
            self._cost_log.warning("model %r: cost() failed (%s): %s; fix the model's cost()", self.model.name,
                                   raised(e), f"this request counts as --max-cost ({cost:g}), so it runs alone"
                                   if bounded else "no --max-cost bounds its batches, so nothing rides on it")
        self.jobs[job.envelope] = job
        self.batcher.add(Pending(key=key, cost=cost, item=job, arrived=now, deadline=job.deadline,
                                 backlog=req.backlog, priority=req.priority,
                                 principal=principal, since=since,
                                 in_order=req.dropped is not None or req.returned is not None
                                 or req.attempt is not None),
                           now, observed=observed)

    def _lone_ready(self) -> bool:
        """Whether the worker may run a request it just admitted at once, if the batcher
        would send it alone (`Batcher.goes_alone`): what `run_ready_batches` after the
        drain would do with it, when the lane is on (`serve`), nothing runs, the model
        does not stream, and neither socket (the broker's, the direct one) holds anything
        more that could join its batch or should go first.  The loop's thread only."""
        if not self.lone_lane or self._busy or self.running or self._streaming:
            return False
        sock = self.sock
        if sock is None:
            return False
        waiter = self._poller
        ds = self.direct_socket
        if waiter is not None:
            # serve's: EVENTS of its sockets (the broker's, the direct ROUTER), and a poll of
            # the descriptors of those that are quiet and of the link's; a message there
            # sends this request the batcher's way, which runs it right after the drain.  The
            # monitor's descriptor is not polled for it (a connection event has no request
            # to join this one's batch or go first, and the syscall is a few percent of a
            # small request); one that this wake-up's wait found counts, below.
            link = ds.link if ds is not None else None
            if (link is not None and link.inbox) or waiter.any_message(descriptors=link is not None):
                return False
            if self._monitor_fd in self._events:
                # A connection event came in this same wake-up: if the connection came back,
                # the reconnect that follows gives what we hold back to the broker, which
                # retries it elsewhere; this request must not run here first.
                return False
        elif _holds_message(sock) or (ds is not None and ds.has_message()):
            return False
        if self.cuda:  # the plane may have lowered the batch size since (MemoryWatch)
            self.batcher.max_batch = self.plane.batch_limit(self.max_batch)
        return True

    # ------------------------------------------------------------------ running

    def run_ready_batches(self, force: bool = False) -> None:
        """Run every batch the batcher yields now (``force``: without waiting for company,
        to drain), answering expired requests first; stops while a batch is offloaded."""
        batcher = self.batcher
        while not self._busy:
            if self._reconnect_why is not None and not force:
                return  # what is queued carries dead tokens: the loop reconnects (and drops it) first
            if not len(batcher):
                batcher.idle()  # as an empty take(idle=True): the batcher is not busy any more
                return
            now = time.monotonic()
            for p in self.batcher.expire(now):
                self.jobs.pop(p.item.envelope, None)
                self._reply_error(p.item, P.ErrorCode.DEADLINE_EXCEEDED, self._expired_why(p, now))
            self.batcher.max_batch = self.plane.batch_limit(self.max_batch)
            batch = self.batcher.take(now, idle=True, force=force)
            if not batch:
                return
            jobs = [p.item for p in batch]
            for job in jobs:
                self.jobs.pop(job.envelope, None)
            self._run(jobs, now)
            if not force and len(batcher) and not self._busy and self._word_waits():
                # More to run, and a message waits: the loop reads it first (a CANCEL, a
                # client's DISCONNECT), then comes back.  Run back to back, the queued calls
                # of a pinned client that had closed ran for nobody (the leases audit).
                return

    def _word_waits(self) -> bool:
        """Whether a message waits on the broker's socket or the direct one (a look, no read
        of a message; the link's kernel queue is read into its inbox)."""
        sock = self.sock
        if sock is not None and not sock.closed and sock_events(sock) & _POLLIN:
            return True
        ds = self.direct_socket
        return ds is not None and ds.has_message()

    def _expired_why(self, p: Pending, now: float) -> str:
        if p.deadline is not None and p.deadline > now:
            return (f"not run: {(p.deadline - now) * 1e3:.1f} ms were left before its deadline, and a "
                    f"batch of this model takes at least {self.batcher.deadline_margin * 1e3:.1f} ms "
                    f"here while other requests wait; allow more time, or lower the load")
        return "deadline passed while waiting for a batch"

    def _run(self, jobs: list[Job], started: float) -> None:
        if self._streaming:
            for job in jobs:
                self._run_stream(job)
            return
        self.running = {job.envelope: job for job in jobs}  # a CANCEL now drops its result
        offload = self._offload is not None and self.compute_times.offload(len(jobs))
        predicted = self.compute_times.recent(len(jobs))  # one slow outlier does not make it long
        self._batch_at = started
        # Offloaded with no timing: nothing says it is short.
        self._batch_predicted = float("inf") if offload and predicted is None else predicted
        if self.leases is not None and runs_long(0.0, self._batch_predicted):
            self._maybe_tell_busy(started)
            self._bounce_pending()
        if offload:
            self._busy = True
            if self._poller is not None:
                self._poller.add(self._offload.done)
            self._offload.submit(jobs, started)
            return
        t0 = time.perf_counter()
        beats = self._heartbeats
        if beats is not None:
            beats.computing_begin()  # the upstream socket is the heartbeat thread's meanwhile
        try:
            outputs = self._run_model(jobs)
            error = None
        except Exception as e:
            outputs, error = None, e
        finally:
            if beats is not None:
                beats.computing_end()
        seconds = time.perf_counter() - t0
        if self._stash or self._stash_direct or self._returned_early or self._bounced_early:
            self._after_compute()  # a CANCEL read meanwhile drops a result before it is written
        if self._reconnect_why is not None or seconds > self.heartbeat_interval:
            # A DISCONNECT read meanwhile, or long enough for a broker restart to matter (the
            # monitor is asked only then: a syscall a batch on the lone request's path).
            self._note_replaced()
        self._complete(jobs, started, outputs, error, seconds)
        if self._busy:  # a batch finished on the loop thread can't leave the flag set
            self._busy = False

    def _run_model(self, jobs: list) -> list:
        """The model on a batch (the data plane's run), on the loop's thread or the compute
        thread.  A batch that raises, or returns outputs no reply can carry (`_check_each`), is
        run again in halves, down to single requests, so that one request (one client's bad
        input) fails alone and the others get their results;
        each failed request's place holds a `ModelFailed`.  (A model is a function of its
        inputs: a batch that raised left nothing behind.)"""
        try:
            outs = self.plane.run(jobs)
            if len(outs) > 1:
                _check_each(outs)
        except BaseException as e:
            first = model_fault(e)
        else:
            if os.getpid() != self.pid:  # a child the model forked returned here (a syscall a batch:
                end_forked_child()       # a flag set at fork would miss a fork made in C)
            return outs
        outs = self._isolate(jobs, first)
        if len(jobs) > 1 and not any(type(o) is ModelFailed for o in outs):
            # Every request served alone: the model fails on batches only (a wrong leading
            # axis, say), its compute paid over again on every one, and nothing said so (a
            # request that fails alone has its own ERROR line: `_complete`).  What failed
            # is said as it was: outputs refused (`_check_each`, a backend's `BadOutputs`)
            # were called "raised on a batch", which the model never did.
            self._isolate_log.warning("model %r %s on a batch of %d (%s) and served each of its requests when "
                                      "run again in smaller batches: it fails on batches, and pays its compute "
                                      "twice or more each time (fix it, or --max-batch 1)", self.model.name,
                                      *_failed_how(first.error, len(jobs)))
        return outs

    def _isolate(self, jobs: list, failed: ModelFailed) -> list:
        """``jobs``, whose batch raised ``failed`` (or returned outputs no reply can carry:
        `_check_each`, on every run here): each half run again (cancelled requests are
        not), recursively.  What a run returns is copied before the next run: a model
        may fill the same output buffer on every call, and these replies are written only
        after the last run.  A stale request (its broker connection replaced meanwhile) runs
        again: as after a batch that did not raise, its result may still go straight to its
        client (`_reply_tensors`); skipped, it was answered with the other request's error
        (a good request failed 500 naming another's bad input: the races hunt).  The copy is
        the plane's (`detach`): a CUDA plane's is queued on the worker stream, after the
        kernels that made the outputs (a copy on the thread's default stream could read
        them before they were written, or after the next half's kernels reused their
        memory: the GPU read-through)."""
        if len(jobs) == 1:
            return [failed]
        mid = len(jobs) // 2
        outs: list = []
        for half in (jobs[:mid], jobs[mid:]):
            live = [j for j in half if not j.cancelled]
            if not live:
                outs.extend(failed for _ in half)  # answered CANCELLED anyway
                continue
            try:
                got = self.plane.run(live)
                _check_each(got)
                got = self.plane.detach(got)
            except BaseException as e:
                got = self._isolate(live, model_fault(e))
            # Matched to `live` as it was run, not by asking again which are cancelled: on
            # the compute thread the loop marks a CANCEL meanwhile, and the request after
            # the cancelled one took its output (the fidelity hunt).  A request cancelled
            # since gets its output here and is answered CANCELLED (`_reply_batch`).
            ran = {id(j): out for j, out in zip(live, got)}
            outs.extend(ran.get(id(j), failed) for j in half)
        return outs

    def _finish_offloaded(self) -> None:
        jobs, started, outputs, error, seconds = self._offload.result()
        self._busy = False
        if self._poller is not None:
            self._poller.remove(self._offload.done)
        self._note_replaced()  # before the drain and the monitor's check of this pass
        self._complete(jobs, started, outputs, error, seconds)

    def _note_replaced(self) -> None:
        """If the broker connection was replaced (a DISCONNECT read, or the monitor saw it
        come back), the running brokered jobs' replies would go through a broker that does
        not know them: marked stale (`_reply_tensors` writes nothing for them)."""
        if self._reconnect_why is None and self._monitor_fd is not None and self.upstream.reconnected():
            self._reconnect_why = "broker connection re-established"
        if self._reconnect_why is not None:
            for job in self.running.values():
                if job.route is None:
                    job.stale = True

    def _complete(self, jobs, started, outputs, error, seconds: float) -> None:
        self.running = {}
        self._batch_over()
        n = len(jobs)
        try:
            if error is not None:
                # The batch's request ids ride along: at the errors-only level this is the
                # one line about these requests.  (Not for the requests' own fault: each is
                # an INFO "request failed", as a 422 before the model ran.)
                if not isinstance(error, _request_faults()):
                        log.error("model %s failed on a batch of %d: %r", self.model.name, n, error,
                              extra={"service": self.service,
                                     "rids": [logs.request_id(job.req) for job in jobs if job.req is not None]})
                for job in jobs:
                    self._reply_model_error(job, error)
                return
            if gathers_finals(n):
                self.batch_finals = BatchFinals()
            try:
                self._reply_batch(jobs, outputs, started, seconds * 1e3, n)
            finally:
                if self.batch_finals is not None:
                    self._send_batch_finals()
        finally:
            # The records the replies do not need, once they are on their way (the next
            # batch's predictions and keep-warm's idle clock read them, nothing before).
            if error is None and not any(type(o) is ModelFailed for o in outputs):
                # (a batch run again in parts says nothing of what a batch of n costs)
                ct = self.compute_times
                ct.observe(n, seconds)
                if not self._streaming:  # `_set_margin`, inline: after every batch
                    self.batcher.deadline_margin = ct._floor
            self.keep_warm.busy(seconds, time.monotonic())
            if self.counts and error is None:
                self._hist["batch"].observe(n)
        self.served += n
        if seconds >= self.dones.delay:
            # Gathering DONEs saves the broker wake-ups on small requests; after a batch this
            # long it saves nothing, and the broker should know at once that we are free
            # (it may be holding work back for us: RECALL).
            self._flush_done()

    def _reply_batch(self, jobs, outputs, started, compute_ms: float, n: int) -> None:
        info = log.isEnabledFor(logging.INFO)  # once per batch: levels that are off cost nothing more
        tracing = self.tracing
        if tracing is not None:
            tracing.batch(started, compute_ms, n)
        failed = [(job, out.error) for job, out in zip(jobs, outputs)
                  if type(out) is ModelFailed and not job.cancelled]
        if failed:  # (inputs the model refused are their requests' fault: INFO lines of their own)
            faults = _request_faults()
            failed = [(job, e) for job, e in failed if not isinstance(e, faults)]
        if failed:
            # One line a batch, with the failed requests' ids (at the errors-only level, the
            # one line about them); the others in it were run again alone and served.
            others = "" if len(failed) == n else f" ({len(failed)} of its requests; the others were served)"
            first = failed[0][1]
            extra = {"service": self.service,
                     "rids": [logs.request_id(job.req) for job, _ in failed if job.req is not None]}
            if isinstance(first, _output_faults()):  # it returned them, and raised nothing
                log.error("model %s returned outputs no reply can carry on a batch of %d: %s%s", self.model.name, n,
                          message_of(first), others, extra=extra)
            else:
                log.error("model %s failed on a batch of %d: %r%s", self.model.name, n, first, others, extra=extra)
        for job, out in zip(jobs, outputs):
            if job.cancelled:
                self._cancelled(job, job.cancelled, "while its batch ran; its result was dropped")
                continue
            if type(out) is ModelFailed:
                self._reply_model_error(job, out.error)
                continue
            timing = {
                "batch_wait_ms": (started - job.received) * 1e3,
                "input_ms": job.input_ms,
                "compute_ms": compute_ms,
                "batch": float(n),
            }
            if job.req.queue_ms is not None:
                timing["queue_ms"] = job.req.queue_ms
            if job.req.returned:
                timing["returned"] = float(job.req.returned)
            try:
                # (a batch of more than one had its outputs checked: `_run_model`)
                refs = self._reply_tensors(job, out, timing, final=True, checked=n > 1)
                if self.counts:
                    hist = self._hist
                    hist["compute"].observe(compute_ms / 1e3)
                    hist["input"].observe(job.input_ms / 1e3)
                    hist["output"].observe(timing["output_ms"] / 1e3)
            except Exception as e:  # one bad output must not take the worker (and its other requests) down
                if isinstance(e, ReplyTooLarge):  # the broker's limit, not the model's mistake
                    self._too_large.warning("request %d: %s", job.req.id, e, extra=logs.request_fields(job.req))
                    self._reply_error(job, P.ErrorCode.INTERNAL, refused_outputs(self.model.name, e))
                elif isinstance(e, OutputRefused):  # the model's own mistake: a line, not a traceback
                    log.error("model %s returned outputs no reply can carry for request %d: %s", self.model.name,
                              job.req.id, e, extra=logs.request_fields(job.req))
                    self._reply_error(job, P.ErrorCode.INTERNAL, refused_outputs(self.model.name, e))
                else:
                    log.exception("could not send the outputs of request %d", job.req.id,
                                  extra=logs.request_fields(job.req))
                    self._reply_error(job, P.ErrorCode.INTERNAL, f"could not send outputs: {raised(e)}")
                continue
            if info:
                log.info("request done", extra=logs.done_fields(job.req, self.service, timing))
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("request tensors", extra=logs.tensor_fields(job.req, refs))
            if tracing is not None:
                tracing.request(job, timing)

    def _run_stream(self, job: Job) -> None:
        seq = 0
        out_ms = 0.0  # the partials' output writing, for the histogram
        start = time.monotonic()
        t0 = time.perf_counter()
        self.running = {job.envelope: job}
        self._batch_at = start  # the head-of-line rule of leases: a stream's length is unknown
        # Every wait the request had, on each PARTIAL and the FINAL (as a batch reply shows).
        waits = {"batch_wait_ms": (start - job.received) * 1e3, "input_ms": job.input_ms}
        if job.req.queue_ms is not None:
            waits["queue_ms"] = job.req.queue_ms
        if job.req.returned:
            waits["returned"] = float(job.req.returned)
        outs = None
        try:
            try:
                outs = iter(self.backend.run_stream(job.inputs, meta=job.req.meta))
            except BaseException as e:
                return self._stream_failed(job, outs, model_fault(e), seq)
            beats = self._heartbeats
            while True:
                # The model computes inside next(): heartbeats are the thread's meanwhile, the
                # PARTIALs between are the loop's (the socket changes hands at each boundary).
                if beats is not None:
                    beats.computing_begin()
                fault = None
                try:
                    out = next(outs, _END)
                except BaseException as e:
                    fault = model_fault(e)
                finally:
                    if beats is not None:
                        beats.computing_end()
                if fault is not None:  # (the socket is the loop's again)
                    return self._stream_failed(job, outs, fault, seq)
                # Between partials: what arrived meanwhile, then what is in the socket, so
                # that a CANCEL stops the model here, at its next partial.
                self._after_compute()
                self._drain()
                self._drain_direct()
                if self.leases is not None:
                    self._maybe_tell_busy(time.monotonic())
                    self._bounce_pending()
                    if self._held:
                        self._send_held()
                    # A leased stream's partials go on the direct socket, not to the broker,
                    # and the heartbeat thread holds the socket only inside next(): a model
                    # that yields fast left the broker hearing nothing for the whole stream,
                    # and past its liveness window it presumed the worker dead, ended its
                    # leases (the stream failed at its client) and retried what it held.
                    self._heartbeat_if_due()
                if job.route is None and not job.stale:
                    # The broker connection replaced under the stream (the loop registers
                    # again once it ends): its PARTIALs would be dropped, their output slots
                    # held by the client for good.  The client, told of the restart by its
                    # heartbeat answers, fails the call (a stream cannot be replayed).
                    self._note_replaced()
                if job.stale:
                    self._close_stream(outs)
                    log.info("stream of request %d ended after %d partial(s): its broker connection was replaced",
                             job.req.id, seq, extra=logs.request_fields(job.req))
                    self.served += 1
                    return
                if job.cancelled:
                    self._close_stream(outs)
                    if job.cancelled is _UNSENDABLE:
                        # Nobody to tell (its connection is gone or stopped reading): its
                        # lease slot is freed, nothing is sent, and it counts as client_gone.
                        self.leases.finish(job.envelope)
                        if self.counts:
                            self._count_leased(job, sent=False)
                        log.info("stream of leased request %d stopped after %d partial(s): its connection is gone",
                                 job.req.id, seq, extra=logs.request_fields(job.req))
                    elif job.cancelled is _UNREAD:
                        # Its client is alive but read nothing for STREAM_WAIT_S: the stream
                        # cannot wait for it longer (everything else on this worker waits
                        # meanwhile), so it ends with an error, which the client gets after
                        # the partials queued for it (the last one counted did not go), as
                        # on the local link, where such a client's connection is retired.
                        sent = seq - 1
                        log.warning("stream of leased request %d cut after %d partial(s): its client is not reading "
                                    "its replies on the direct socket", job.req.id, sent,
                                    extra=logs.request_fields(job.req))
                        self._reply_error(job, P.ErrorCode.WORKER_FAILED, (
                            f"the stream was cut after {sent} partial result(s): this client read none of its replies "
                            f"for {STREAM_WAIT_S:g} s while {self.direct_socket.sndhwm} waited for it on the worker's "
                            "direct socket (a stream cannot wait longer for one client, nor be run again)"))
                    else:
                        self._cancelled(job, job.cancelled, f"after {seq} partial result(s)")
                    self.served += 1
                    return
                if out is _END:
                    break
                part = {**waits, "compute_ms": (time.perf_counter() - t0) * 1e3}
                try:
                    self._reply_tensors(job, out, part, final=False, seq=seq)
                except Exception as e:  # what it yielded cannot be sent (not a dict, too many outputs...)
                    return self._stream_failed(job, outs, ModelFailed(e), seq)
                out_ms += part.get("output_ms", 0.0)
                seq += 1
            timing = {**waits, "compute_ms": (time.perf_counter() - t0) * 1e3}
            self._reply(job, True, [P.encode_header(P.Reply(id=job.req.id, seq=seq, timing=timing))])
            self.served += 1
            if self.counts:  # a stream is a batch of one: its whole run, and its partials' writing
                hist = self._hist
                hist["compute"].observe(timing["compute_ms"] / 1e3)
                hist["input"].observe(job.input_ms / 1e3)
                hist["output"].observe(out_ms / 1e3)
                hist["batch"].observe(1)
            if log.isEnabledFor(logging.INFO):
                log.info("request done", extra={**logs.done_fields(job.req, self.service, timing), "partials": seq})
        finally:
            self.running = {}
            self._batch_over()

    def _close_stream(self, outs) -> None:
        """End a streaming model's generator now (its finally blocks run); what it raises
        doing so is logged, never the loop's end."""
        close = getattr(outs, "close", None)
        if close is not None:
            try:
                close()
            except BaseException as e:
                model_fault(e)  # (a Ctrl-C goes on)
                self._oops.exception("closing a stream of %s failed", self.model.name)

    def _stream_failed(self, job: Job, outs, failed: ModelFailed, seq: int) -> None:
        """The streaming model raised, or yielded what cannot be sent: its request fails
        after the partials it had; the worker and everyone else's requests go on."""
        self._close_stream(outs)
        if seq == 0 and isinstance(failed.error, _request_faults()):  # its inputs, before any partial
            self._reply_model_error(job, failed.error)  # (the request's fault: an INFO line)
        else:
            log.error("model %s failed on streaming request %d after %d partial(s): %r", self.model.name,
                      job.req.id, seq, failed.error, extra=logs.request_fields(job.req))
            if isinstance(failed.error, _output_faults()):
                self._reply_error(job, P.ErrorCode.INTERNAL, f"{refused_outputs(self.model.name, failed.error)} "
                                  f"(after {seq} partial result(s))")
            else:
                self._reply_error(job, P.ErrorCode.INTERNAL, f"model {self.model.name!r} raised "
                                  f"{type(failed.error).__name__} after {seq} partial result(s): "
                                  f"{message_of(failed.error)}")
        self.served += 1

    # ------------------------------------------------------------------ replying

    def _reply_tensors(self, job: Job, out: dict, timing: dict, *, final: bool, seq: int = 0,
                       checked: bool = False) -> list:
        if job.stale and self._relayed(job, final):
            # Its broker connection was replaced: relayed, the reply would be dropped, and
            # an output slot it names would stay lent to its (live) client.  Not written.
            timing["output_ms"] = 0.0
            self.stale_replies += 1
            return []
        t0 = time.perf_counter()
        limit = self._max_reply_frame  # (a tcp backend's: only for a reply through the broker)
        if limit is not None and not self._relayed(job, final):
            limit = None
        refs, frames = self.plane.write_outputs(job, out, checked, limit)
        if frames:
            self._count_big(frames)
        timing["output_ms"] = (time.perf_counter() - t0) * 1e3
        header = P.encode_header(P.Reply(id=job.req.id, tensors=refs, timing=timing, seq=seq))
        self._reply(job, final, [header, *frames])
        return refs

    def _reply_model_error(self, job: Job, e: BaseException) -> None:
        """What running the model on ``job`` raised: an input its framework cannot hold (a
        dtype torch lacks) or the model refused (`models.InvalidInput`) is the request's fault
        (INVALID_INPUT; it was an INTERNAL error, "retrying may help": the data hunt); anything
        else the model's."""
        if isinstance(e, _request_faults()):
            self._reply_error(job, P.ErrorCode.INVALID_INPUT, f"model {self.model.name!r} cannot take this "
                              f"request's inputs: {raised(e)} (the model refused them as it ran: send inputs "
                              f"it takes; the same ones again fail the same way)")
        elif isinstance(e, _output_faults()):
            self._reply_error(job, P.ErrorCode.INTERNAL, refused_outputs(self.model.name, e))
        else:
            self._reply_error(job, P.ErrorCode.INTERNAL, f"model {self.model.name!r} raised {raised(e)}")

    def _reply_error(self, job: Job, code: int, message: str, resend: bool = False) -> None:
        """Answer ``job`` with an error; ``resend``: a leased request told to resend it
        through the broker (`Job.resend`)."""
        rid = job.req.id if job.req is not None else 0
        if job.req is not None and log.isEnabledFor(logging.INFO):
            log.info("request failed: %s", message, extra={**logs.request_fields(job.req), "service": self.service,
                                                            "code": int(code)})
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request tensors", extra=logs.tensor_fields(job.req))
        self.plane.finish_reads(job)
        job.code = int(code)
        job.resend = resend
        self._reply(job, True, P.error_body(rid, code, message))

    def _relayed(self, job: Job, final: bool) -> bool:
        """Whether a reply of ``job`` would go through the broker (not leased, not direct)."""
        if job.route is not None:
            return False
        endpoint = direct_endpoint(final, job.req, host=self.host, enabled=self._direct_ok or job.stale,
                                   streaming=self._streaming)
        return endpoint is None or self.direct.open(endpoint) is None

    def _reply(self, job: Job, final: bool, body: list) -> None:
        """Send one reply: a FINAL straight to a same-host client that gave a reply_to
        socket (direct reply), anything else through the broker; a leased request's replies
        on the direct socket, to the connection that sent it."""
        if job.route is not None:
            self._reply_leased(job, final, body)
            return
        endpoint = direct_endpoint(final, job.req, host=self.host, enabled=self._direct_ok or job.stale,
                                   streaming=self._streaming)
        if endpoint is not None and self.direct.open(endpoint) is not None:
            if self.batch_finals is not None and len(body) == 1:
                self.batch_finals.add(endpoint, body[0], job)
                return
            # A full socket (the client stopped reading, or died) keeps the replies already
            # queued (they were told to the broker as DONE); this one goes through the
            # broker, which knows whether the client is still there.
            if self.direct.send(endpoint, P.client_reply(True, self._service_b, body)):
                self._note_done(job)
                self.direct_sent += 1
                return
            limit = self._max_reply_frame  # (its outputs were written for the direct socket)
            if limit is not None and any(len(f) > limit for f in body[1:]):
                big = max(len(f) for f in body[1:])
                body = P.error_body(job.req.id if job.req is not None else 0, P.ErrorCode.INTERNAL, (
                    f"the direct reply could not go (its client's socket full or gone), and through the broker an "
                    f"output frame of {big} bytes is over the {limit} it reads from this worker (its --max-reply-mb): "
                    f"the same request fails the same way when its client does not read"))
        self._send(P.worker_reply(job.envelope, final, body))

    def _send_batch_finals(self) -> None:
        """Send the header-only FINALs gathered while a batch was answered: one message per
        client (FINALS), instead of one per request."""
        finals, self.batch_finals = self.batch_finals, None
        if not finals:
            return
        for endpoint, frames, items in finals.messages(self._service_b):
            # The socket may have been closed since (least recently used), be full or fail:
            # then relay each through the broker instead.
            if not self.direct.send(endpoint, frames, keep_failed=True):
                for head, job in items:
                    self._send(P.worker_reply(job.envelope, True, [head]))
                continue
            for _, job in items:
                self._note_done(job)
            self.direct_sent += len(items)

    def _note_done(self, job: Job) -> None:
        """Remember that `job`'s FINAL went straight to its client (gpu_worker.direct); not
        a stale one's (its token died with the connection it came on: the broker it would
        go to counts it `dropped_late`)."""
        if job.stale:
            return
        self.dones.add(job.envelope, job.deadline, time.monotonic(), job.code)

    def _flush_done(self) -> None:
        """Tell the broker which FINALs went straight to their clients (returns our credit)."""
        for frames in self.dones.take(time.monotonic()):
            self._send(frames)

    def _send_stats(self) -> None:
        """STATS to our broker (one that sent WELCOME: a plain MDP broker would not know the
        command): the histograms' counts since the last one, keep-warm runs, pool use; only
        when something changed."""
        if not self.counts:
            # (a broker that counts nothing, maybe since a WELCOME just now: what waited goes,
            # or the loop's wait for it would stay at 0 ms for good: found by review)
            self._leased_outcomes, self._leased_since = {}, None
            return
        if not self._stats_open():
            # No broker to count them now (ours died, or we are registering with its
            # successor, which drops a stranger's STATS): kept, and sent once one has
            # registered us.  Pinned requests run on a lease while the broker was down went
            # uncounted at the restarted broker (the counts hunt).
            return
        try:
            usage = self.plane.usage()
        except Exception:
            self._oops.exception("could not read the pools' use")
            usage = {}
        warm = self.keep_warm.runs - self._stats_warm
        hist = self._hist
        leased = self._leased_outcomes
        dropped = self._leased_dropped
        if not warm and not leased and not dropped and usage == self._stats_usage and \
                not any(h.sum or any(h.counts) for h in hist.values()):
            return
        fields = {name: h.take() for name, h in hist.items()}
        self._leased_outcomes = {}
        self._leased_since = None
        self._leased_dropped = 0
        self._stats_warm += warm
        self._stats_usage = usage
        self._send(P.worker_stats(P.WorkerStats(keep_warm_runs=warm, leased=leased or None, leased_dropped=dropped,
                                                **fields, **usage)))

    def _stats_open(self) -> bool:
        """Whether a STATS sent now reaches a broker that has registered us: a WELCOME since
        the last (re)connect, and the connection not seen closed since (the monitor's
        word).  What goes before that is lost, or dropped by a broker that does not know us."""
        return self.registered and getattr(self.upstream, "connected", True)

    def _fail_pending(self, why: str) -> None:
        # The broker retries these elsewhere; our replies would carry dead tokens.  What
        # runs now may still answer its client directly; through the broker, nothing of it
        # is written (`_reply_tensors`): an output slot in a reply that is dropped would be
        # lent to a live client for good.
        for job in self.running.values():
            if job.route is None:
                job.stale = True
            elif self.leases is not None:
                # Its lease ends below, and its FINAL still goes on its connection (counted
                # here when it does).  One that finds the connection gone is not
                # `client_gone`: its client sent it through the broker, which counts it
                # there (one request counted twice: the pause hunt).  (Bounded: counted or
                # not, at most the jobs of a few batches are ever here.)
                if len(self._lease_lost) >= 4096:
                    self._lease_lost.clear()
                self._lease_lost.add(job.envelope)
        for p in self.batcher.drop(lambda p: True):
            job = p.item
            if job.route is not None and self.leases is not None:
                # A leased request not started: its client waits on a connection that
                # stays up, and no LEASE_END will come (the broker is gone): told to resend
                # it through the broker, where the broker's silence then fails it in time
                # (dropped, it waited forever without a timeout: found by review).
                self.jobs.pop(job.envelope, None)
                self._reply_error(job, P.ErrorCode.SERVICE_UNAVAILABLE,
                                  f"this connection's lease ended ({why}); resend this request through the broker "
                                  "(it did not run)", resend=True)
        self.jobs.clear()
        self.dones.clear()
        if self.leases is not None:
            # The broker presumes us gone (or is a new one): our leases are over.  Their
            # clients send new calls through the broker; those on their connections wait
            # for what we still run (a new broker tells them nothing: docs/protocol.md
            # section 10.7), so a FINAL held for a client not reading now still goes
            # (`_send_held`; dropped, its call waited for its deadline, or for ever).
            self.leases.reset(why)
            self._leaseholders_changed()

    # ------------------------------------------------------------------ leases (--direct)

    def _leaseholders_changed(self) -> None:
        """A tcp direct socket admits the keys of the clients holding a lease now."""
        ds = self.direct_socket
        if ds is not None and ds.public_key is not None:
            ds.allow(lease.grant.principal for lease in self.leases.leases.values())

    def _on_lease(self, grant: P.LeaseGrant) -> None:
        """LEASE: take it (the client is told where to connect only after our LEASED)."""
        if self.leases is None:
            why = "this worker takes no leases (it was started without --direct)"
        elif grant.service != self.service:
            why = f"this worker serves {self.service!r}, not {grant.service!r}"
        elif self._fd_guard is not None and self._fd_guard.paused:
            why = (f"this worker is near its descriptor limit ({self._fd_guard.used} of {self._fd_guard.limit} "
                   f"in use): it takes no new leaseholder now")
        else:
            why = self.leases.grant(grant)
        if why is None:
            log.info("leased %d slot(s) to pid %s (lease %s)", grant.slots, grant.client_pid, grant.lease.hex())
            self._leaseholders_changed()  # before LEASED: the client connects once it hears
            self._send(P.worker_leased(grant.lease))
        else:
            self._bad_direct.warning("refused lease %s: %s", grant.lease.hex(), why)
            self._send(P.worker_leased(grant.lease, P.error_body(0, P.ErrorCode.SERVICE_UNAVAILABLE, why)[0]))

    def _watch_descriptors(self) -> None:
        """Once a housekeeping interval, for a worker with an ipc direct socket: near its
        descriptor limit, take no new lease and move the socket's file aside (libzmq's ipc
        listener aborts the process when accept() fails with EMFILE; each client costs a
        worker descriptors: its mapped segments, a pidfd, a reply socket); back once they
        are under the mark again (broker.protocol.limits.Headroom)."""
        guard = self._fd_guard
        if guard is None:
            return
        change = guard.watch()
        if change is None:
            return
        path = self.direct_socket.path
        if change == "pause":
            try:
                self._direct_aside = move_aside(path)
            except OSError as e:
                log.error("cannot move the direct socket's file %s aside: %s", path, e)
            log.warning("%d of this worker's %d descriptors are in use: it takes no new lease, and new "
                        "connections to its direct socket wait, until some close (at the limit libzmq would abort "
                        "it); raise its descriptor limit", guard.used, guard.limit)
            return
        aside = self._direct_aside
        if aside is not None:
            try:
                put_back(aside, path)
                self._direct_aside = None
            except OSError as e:
                log.error("cannot put the direct socket's file %s back: %s", path, e)
        log.warning("%d of %d descriptors in use: taking leases again", guard.used, guard.limit)

    def _count_big(self, frames) -> None:
        """A request's or reply's inline frames, for the burst they may be part of (`BurstSeen`)."""
        n = 0
        for f in frames:
            n += len(f)
        if n >= _BIG_FRAMES:
            self._burst.moved += n

    def _trim_after_closes(self) -> None:
        """Once a housekeeping interval: after a burst of inline tensors (`BurstSeen`), and,
        for a worker with a direct socket, after many closes.  libzmq keeps each
        connection's buffers (~40 KB) in the C heap, and glibc kept them after the connection
        closed (1,500 leaseholder connections that came and left together: 30-45 MB more for
        good; the churn hunt).  After many of the worker's descriptors closed, the heap's free
        memory goes back to the kernel, on a thread (ctypes lets go of the GIL; a malloc from
        the arena being trimmed waits for it, as in the broker's housekeeping)."""
        trimming = self._trimming is not None and self._trimming.is_alive()
        burst = not trimming and self._burst.due(time.monotonic())  # (a trim it asks for is not lost to one running)
        closes = False
        if self.direct_socket is not None:
            guard = self._fd_guard
            used = guard.used if guard is not None else open_descriptors()  # (the guard has just listed them)
            # Its connections that ended count too: a crowd that came and left between two
            # looks leaves no fall in the descriptors to see.
            closes = self._closes.look(used, self.direct_socket.closed_connections())
        if not (burst or closes) or trimming:
            return
        if closes:
            self._closes.trimmed()
        self._trimming = start_trim()  # (None: no thread to be had, skipped)

    def _on_lease_end(self, end: P.LeaseEnd) -> None:
        """LEASE_END from the broker: forget the lease; what it holds finishes and answers
        as usual, except, its client gone, the requests not started: each is answered 503,
        "resend it through the broker".

        ``client_gone`` is the broker's word that it heard nothing from the client for its
        liveness window, which a client cut off from the broker but not from us also earns:
        its running requests still answer it on their connection (a dead client's is gone,
        and a stream stops at its first partial that cannot be sent), and those not started
        go back to it, cheaply, to be sent through the broker (they were cancelled, 499,
        though the client had cancelled nothing: found by the network hunt)."""
        held = self.leases is not None and bool(self._held) and end.reason == "client_gone"
        routes = set(self.leases.leases[end.lease].routes) if held and end.lease in self.leases else ()
        lease = None if self.leases is None else self.leases.end(end.lease, end.reason)
        if lease is None:
            return
        self._leaseholders_changed()
        log.info("lease %s ended (%s)", end.lease.hex(), end.reason)
        if held:
            self._drop_held(lease.in_flight, routes)
        if end.reason != "client_gone" or not lease.in_flight:
            return
        keys = set(lease.in_flight)
        for p in self.batcher.drop(lambda p: p.item.envelope in keys):
            job = p.item
            self.jobs.pop(job.envelope, None)
            self._reply_error(job, P.ErrorCode.SERVICE_UNAVAILABLE,
                              "this connection's lease ended (client_gone: the broker heard nothing from this client "
                              "for its liveness window); resend this request through the broker (it did not run)",
                              resend=True)

    def _end_leases(self) -> None:
        """Stopping: end every lease at the broker (it tells their clients, who send new
        requests through it); from now on a direct REQUEST is answered 503."""
        if self.leases is None:
            return
        ids = self.leases.stop()
        self._leaseholders_changed()
        for lid in ids:
            self._send(P.worker_lease_end(lid, P.encode_header(P.LeaseEnd(lease=lid, reason="worker_stopping"))))
        if ids:
            # A request its client sent before it heard of the end still gets its 503.
            self._linger_until = time.monotonic() + self.heartbeat_interval
            log.info("ended %d lease(s): the worker is stopping", len(ids))

    def _drain_direct(self, most: int = 1000, router: bool = True, link: bool = True) -> None:
        """Handle what waits on the direct socket (at most ``most`` messages: a flood of
        them never starves the broker's heartbeats)."""
        ds = self.direct_socket
        if ds is None:
            return
        self._lane_ran = False
        while most > 0 and not self._lane_ran:  # one lane batch, as `_drain`
            frames = ds.next_message(router, link)
            if frames is None:
                return
            most -= 1
            self._on_direct_frames(frames, time.monotonic())

    def _on_direct_frames(self, frames, now: float) -> None:
        """One message read from the direct socket at ``now`` (its arrival): handled, or
        logged and dropped when malformed."""
        try:
            self._on_direct(frames, now)
        except P.ProtocolError as e:
            self._bad_direct.warning("malformed message on the direct socket: %s", e)
        except Exception:
            self._oops.exception("unexpected error while handling a message on the direct socket; dropped it")

    def _on_direct(self, frames, now: float) -> None:
        """One message on the direct socket: routing id, then the client sub-protocol."""
        route = bytes(frames[0])
        if (len(frames) >= 5 and bytes(frames[2]) == P.C_REQUEST and bytes(frames[1]) == P.MDPC
                and bytes(frames[3]) == self._service_b):
            # The common case, without building a ClientMessage: a REQUEST for our service.
            self._on_direct_request(route, self._service_b, frames[4:], now)
            return
        rest = frames[1:]
        if len(rest) >= 2 and bytes(rest[0]) == P.MDPC and bytes(rest[1]) == P.C_HELLO:
            if len(rest) != 3:
                raise P.ProtocolError("HELLO is MDPC02, 0x0b, header(LeaseHello)")
            hello = P.decode_lease_hello(rest[2])
            why = self.leases.hello(route, hello.lease, hello.secret)
            if why is not None:
                self._bad_direct.warning("refused a HELLO for lease %s: %s", hello.lease.hex(), why)
            return
        msg = P.parse_client(rest)
        cmd = msg.command
        if cmd == P.C_REQUEST:
            self._on_direct_request(route, msg.service, msg.body, now)
        elif cmd == P.C_CANCEL:
            cancel = P.decode_cancel(msg.body[0])
            key = self.leases.find(route, cancel.id)
            if key is not None:
                self._cancel(key, cancel.expired)
        elif cmd == P.C_DISCONNECT:
            # Its client's goodbye on this connection (our SDK says it when it closes, and
            # sends nothing more there): what it has here is dropped or cancelled, as the
            # broker does at a client's DISCONNECT.  Unstarted, they ran for nobody (a
            # pinned client closed with three queued: all three ran; the leases audit).
            for key in self.leases.unbind(route):
                self._cancel(key, gone=True)
        elif cmd != P.C_HEARTBEAT:
            raise P.ProtocolError(f"command {cmd!r} is not taken on a worker's direct socket")

    def _on_direct_request(self, route: bytes, service: bytes, body, now: float) -> None:
        """A REQUEST (``body``: its frames after the service name) on the direct socket: run
        like a brokered one if its connection's lease has a slot free, with what the broker
        would have set taken from the lease's grant (the attested pid, the client's host)
        and never from the header."""
        if self.running and self._bounce_direct(route, body, now):  # only a running batch bounces
            return
        head, rest = body[0], body[1:]
        req = error = None
        if P.is_header(head):
            try:
                req = P.decode_request(head, frames=rest)
            except P.ProtocolError as e:
                error = e
            rid = P.lenient_request_id(head) if req is None else req.id
        else:
            rid = 0
        self._lease_seq += 1
        key = b"L" + self._lease_seq.to_bytes(8, "big")  # 9 bytes: never a broker token
        lease = self.leases.admit(route, rid, key)
        if type(lease) is Refusal:
            self._direct_send(route, P.error_body(rid, lease.code, lease.message), source=head)
            return
        if service != self._service_b or req is None or error is not None:
            job = Job(key, P.Request(id=rid), None, None, now, None, None, route)
            if service != self._service_b:
                self._reply_error(job, P.ErrorCode.PROTOCOL_ERROR,
                                  f"this worker serves {self.service!r}, not {service[:64]!r}")
            elif error is not None:
                self._reply_error(job, error.code, str(error))
            else:
                self._reply_error(job, P.ErrorCode.PROTOCOL_ERROR,
                                  "a request on a lease takes a header frame first (docs/protocol.md section 5)")
            return
        grant = lease.grant
        near = grant.client_host is not None and grant.client_host == self.host
        if not near and any(type(t.loc) is not P.InlineLoc for t in req.tensors):
            self._reply_error(Job(key, P.Request(id=rid), None, None, now, None, None, route),
                              P.ErrorCode.PROTOCOL_ERROR,
                              "this lease takes inline tensors only (its client is not on the worker's host, or "
                              "has no shared memory): send the tensors inline")
            return
        req.pid = grant.client_pid            # the kernel's word, through the broker: never the header's
        req.pid_start = grant.client_start
        req.host = grant.client_host if near else None
        req.reply_to = None                   # replies go back on this connection
        req.queue_ms = req.returned = req.attempt = None  # the broker's fields: nothing queued it
        req.backlog = 0                       # the lease's other requests are here already
        self._admit(Job(key, req, None, None, now, None, None, route), rest, now, grant.principal)

    def _waits_behind_another(self, lease, now: float) -> float | None:
        """The head-of-line rule of leases (docs/protocol.md section 10.3): how long (ms) the
        batch or stream running now has run, when a request of ``lease`` would wait behind
        it long (`leases.runs_long`) and it holds none of that lease's requests (a lease's
        own requests wait for its own batch, as a stream's do); else None."""
        at = self._batch_at
        if at is None or not self.running or lease is None:
            return None
        running = self.running
        if any(key in running for key in lease.in_flight):
            return None
        grant = lease.grant
        if grant.client_pid is not None:
            # A brokered request of its client's process is not another's either: a stream
            # with more frames in flight than its lease has slots sends the rest through the
            # broker, which may hand them here; each pinned frame behind one was bounced,
            # went through the broker too, and the stream came off its lease (11 of 30
            # frames pinned with one worker: the pause hunt).  (By process: another client
            # of that process, brokered, counts as its own too; another lease's batch never.)
            pid, start = grant.client_pid, grant.client_start
            for job in running.values():
                req = job.req
                if (job.route is None and req is not None and req.pid == pid
                        and (start is None or req.pid_start in (None, start))):
                    return None
        elapsed = now - at
        return elapsed * 1e3 if runs_long(elapsed, self._batch_predicted) else None

    def _bounce_direct(self, route: bytes, body, now: float) -> bool:
        """A leased REQUEST (``body``: its frames after the service) that would wait behind
        another's long batch: answered 429 with "send it through the broker" (the SDK
        resends it there at once, and the lease stays), so the broker can start it on an
        idle worker; whether it was.  Safe on the heartbeat thread while it holds the
        sockets (reads only the lease table and what runs)."""
        leases = self.leases
        if leases is None or leases.stopping:
            return False
        ran_ms = self._waits_behind_another(leases.lease_of(route), now)
        if ran_ms is None:
            return False
        head = body[0] if body else b""
        rid = P.lenient_request_id(head) if P.is_header(head) else 0
        self.leased_bounced += 1
        self._direct_send(route, P.error_body(
            rid, P.ErrorCode.QUEUE_FULL,
            f"this worker is running another's batch ({ran_ms:.0f} ms so far) and would start this request only "
            "after it; send this one through the broker, which can start it on an idle worker (it did not run)"),
            source=head or None)
        return True

    def _bounce_pending(self) -> None:
        """The batch or stream running now runs long (`leases.runs_long`: at its start by
        its prediction, or later, past it): the leased requests waiting in the batcher whose
        lease has none in it are sent back to the broker's path, as one arriving now would
        be (`_bounce_direct`)."""
        leases = self.leases
        at = self._batch_at
        if leases is None or not self.jobs or at is None:
            return
        now = time.monotonic()
        if not runs_long(now - at, self._batch_predicted):
            return
        doomed = {}
        for key, job in self.jobs.items():
            if job.route is not None:
                ran_ms = self._waits_behind_another(leases.lease_of(job.route), now)
                if ran_ms is not None:
                    doomed[key] = ran_ms
        if not doomed:
            return
        for p in self.batcher.drop(lambda p: p.item.envelope in doomed):
            job = self.jobs.pop(p.item.envelope)
            self.leased_bounced += 1
            # As a bounce at arrival: it did not run, so it is no leased outcome (STATS); the
            # broker counts it when the client resends it there.
            self.plane.finish_reads(job)
            leases.finish(job.envelope)
            self._direct_send(job.route, P.error_body(
                job.req.id, P.ErrorCode.QUEUE_FULL,
                f"this worker is running another's batch ({doomed[job.envelope]:.0f} ms so far) and would start "
                "this request only after it; send this one through the broker, which can start it on an idle "
                "worker (it did not run)"))

    def _resumed(self, lost: float, now: float) -> None:
        """The loop began a pass ``lost`` seconds later than its wait allowed: this process
        was stopped (SIGSTOP, a job-control stop of the launcher's process group, a frozen
        container), starved of CPU, or held by a long step.  A broker stopped with it sent
        nothing meanwhile, and would be presumed gone at the thaw (a reconnect, its leases
        ended, its requests sent again by the broker); so the broker's silence counts from
        ``lost`` later, never past now.  A broker that ran meanwhile left its heartbeats
        in the socket, which the silence check reads first."""
        # INFO only for a gap that would have cost something (half the broker's window): a
        # long batch or stream on the loop's thread makes one at every end, said at DEBUG.
        log.log(logging.INFO if lost > self.heartbeat_interval * self.heartbeat_liveness / 2 else logging.DEBUG,
                "the worker's loop did not run for %.3f s (a long batch on its thread, or the process was stopped "
                "or starved of CPU); the broker's silence meanwhile does not count", lost)
        self._last_heard = min(now, self._last_heard + lost)

    def _tell_stopping(self) -> None:
        """Tell our broker STOPPING (once): send nothing new, and count this worker out of
        its service now (readiness, the grace of requests that have no other worker), not
        at the DISCONNECT after the drain.  The loop's thread at the drain, or the heartbeat
        thread while a batch holds the loop (a SIGTERM during it).  Not to a plain broker:
        it would take the command for garbage, nor to one of ours too old to know it (its
        WELCOME says whether it does)."""
        if self._stopping_told or not self._broker_stops or not self.registered:
            return
        self._stopping_told = True
        self._send(P.worker_stopping())

    def _maybe_tell_busy(self, now: float) -> None:
        """Tell the broker BUSY (docs/protocol.md section 10.3) once the batch or stream
        running now runs long: the broker cannot see leased work, nor how long a brokered
        batch runs, and would otherwise take this worker for idle (leased work), or hand it
        requests that wait behind the batch and take back only half of those parked (the
        stalls hunt: a pinned stream's frame, bounced behind a 2 s brokered request, went
        back to that worker, the least loaded by credit, and sat there 1-2 s while newer
        requests were taken back ahead of it; the stream's later results waited for it).
        The loop's thread, or the heartbeat thread while it holds the sockets."""
        at = self._batch_at
        # Only our broker knows BUSY (a plain MDP one would drop it as unknown): registered
        # with a WELCOME on this connection; and only from a worker that takes leases (the
        # broker ignores it from any other).
        if (self._busy_told or at is None or self.leases is None
                or self.broker_instance is None or not self.registered
                or not runs_long(now - at, self._batch_predicted)):
            return
        self._busy_told = True
        self._send(P.worker_busy(True))
        log.debug("told the broker BUSY: a batch of %d runs long", len(self.running))

    def _batch_over(self) -> None:
        """The batch or stream that ran is over (the loop's thread): BUSY off if it was on."""
        self._batch_at = self._batch_predicted = None
        if self._busy_told:
            self._busy_told = False
            self._send(P.worker_busy(False))

    def _reply_leased(self, job: Job, final: bool, body: list) -> None:
        # `_direct_send`, inline: this is every leased reply's path.
        frames = [job.route, P.MDPC, P.C_FINAL if final else P.C_PARTIAL, self._service_b, *body]
        if not self._streaming or self.running.get(job.envelope) is not job or job.cancelled is _UNREAD:
            sent = self.direct_socket.send(frames)
        else:
            # The running stream's replies may come faster than a reading client takes them
            # (large inline partials): at the local link's cap, or the direct socket's full
            # queue, the stream waits for its client while it reads (STREAM_WAIT_S),
            # heartbeating meanwhile; the client was taken for one that stopped reading, and
            # the stream failed (the data hunt).  Nothing else waits (errors, cancels,
            # resends: another client's stall), nor the error ending a stream whose client
            # did not read for that long (its queue is full: it is held at once).
            sent = self.direct_socket.send(frames, STREAM_WAIT_S, self._heartbeat_if_due)
        if sent is True:
            if final:
                self._final_done(job, True)
            return
        if not final:
            if not job.cancelled:
                # Its connection is gone: a stream for nobody stops at its next partial,
                # without an answer; its client alive but not reading: it stops with an
                # error (see _run_stream).
                job.cancelled = _UNREAD if sent is Unsent.FULL else _UNSENDABLE
            return
        if sent is Unsent.FULL:
            # Its client is alive and not reading: the FINAL waits for it (dropped, the client
            # waited for its deadline, or for ever), its lease slot taken until it goes.
            self._hold(job.envelope, frames, job)
            return
        self._final_done(job, False)

    def _final_done(self, job: Job, sent: bool) -> None:
        """A leased request's FINAL went (``sent``), or was dropped: its client is gone."""
        self.leases.finish(job.envelope)  # its slot is free (whether or not the send went)
        self.leased_sent += 1
        if self.counts:
            self._count_leased(job, sent)

    def _hold(self, key, frames: list, job: Job | None) -> None:
        """Keep a FINAL its connection's full queue did not take, to send again (`_send_held`)."""
        if job is None and len(self._held) >= HELD_REFUSALS:
            self._bad_direct.warning("a refusal on the direct socket was dropped: its client is not reading, and "
                                     "%d replies wait already for clients that are not", len(self._held))
            return
        self._bad_direct.warning("a client on the direct socket is not reading its replies: its answers wait for it")
        self._held[key] = (frames, job)

    def _send_held(self) -> None:
        """Send again the FINALs held for clients that were not reading: those that go now,
        or whose connection is gone (dropped: counted as their client gone), are done."""
        send = self.direct_socket.send
        full = set()  # connections found full on this pass: their other FINALs wait too
        for key, (frames, job) in list(self._held.items()):
            route = frames[0]
            if route in full:
                continue
            sent = send(frames)
            if sent is Unsent.FULL:
                full.add(route)
                continue
            del self._held[key]
            if job is not None:
                self._final_done(job, sent is True)

    def _drop_held(self, keys, routes) -> None:
        """The broker presumed a client dead (its lease ended, ``client_gone``): the FINALs
        held for its requests (``keys``) and connections (``routes``) are dropped."""
        for key, (frames, job) in list(self._held.items()):
            if key in keys or frames[0] in routes:
                del self._held[key]
                if job is not None:
                    self._final_done(job, False)

    def _heartbeat_if_due(self) -> None:
        """A heartbeat to the broker if one is due (the loop's thread, holding the sockets,
        while it waits on something other than them)."""
        if time.monotonic() - self.upstream.last_sent >= self.heartbeat_interval:
            self._send(P.worker_heartbeat())

    def _count_leased(self, job: Job, sent: bool = True) -> None:
        """A leased request's FINAL was sent (a result, or the error `_reply_error` set in
        ``job.code``): the broker never sees it, so our next STATS counts it, and a result
        its time from our receipt of the REQUEST to now (`zmq_infer_request_seconds` holds
        results only, as the broker counts a brokered one: a fast error is no fast answer).  A FINAL that found its client gone (``sent`` false) counts as
        `LEASED_CLIENT_GONE`, as the broker counts a brokered request whose client left.
        One told to resend it through the broker is the broker's to count when it comes."""
        code = job.code
        if self._lease_lost and job.envelope in self._lease_lost:
            self._lease_lost.discard(job.envelope)
            if not sent:
                return  # its client resent it through the broker (`_fail_pending`)
        if not sent:
            code = P.LEASED_CLIENT_GONE
        elif job.resend:
            return
        self._leased_outcomes[code] = self._leased_outcomes.get(code, 0) + 1
        now = time.monotonic()
        if self._leased_since is None and self.counts:  # (a broker that counts nothing gets no STATS)
            self._leased_since = now
        if not code:
            self._hist["leased_request"].observe(max(0.0, now - job.received))
        dropped = job.req.dropped if job.req is not None else None
        if dropped and 0 < dropped < 1 << 32 and code != P.ErrorCode.QUEUE_FULL:
            # Frames its latest-wins stream dropped before this one (the broker counts them
            # for brokered requests).  Counted here, with its FINAL: a request sent back
            # (QUEUE_FULL: "resend it through the broker") is counted by the broker then.
            self._leased_dropped += dropped

    def _direct_send(self, route: bytes, body: list, final: bool = True, source=None) -> None:
        """A FINAL (or PARTIAL) to connection ``route`` of the direct socket: the frames the
        broker would relay, after the routing id.  A FINAL that meets a full queue is held
        (`_hold`): its client waits for it.  ``source``: a frame of the message this FINAL
        refuses (a request that never ran), read just now: a full queue then ends the
        connection instead (`DirectSocket.end_connection`) when nothing is in flight on it:
        its client has 10,000 answers unread and waits for none, and a peer that sent
        requests without reading held that much of the worker's memory per connection, on
        as many connections as it made (the churn hunt).  A connection with a request in
        flight (a client paused in a stream, say) keeps its answers held: what the leases'
        slots bound."""
        frames = [route, *P.client_reply(final, self._service_b, body)]
        ds = self.direct_socket
        if source is not None:
            if ds.ended_route(route):
                return  # sent before its connection was ended, read after: for nobody
            ds.note_refused(route, source)
        if ds.send(frames) is Unsent.FULL and final:
            if source is not None and not self.leases.holds(route) and ds.end_connection(route):
                self._bad_direct.warning("ended a connection to the direct socket that does not read its replies "
                                         "(%d wait for it); what waited is dropped", ds.sndhwm)
                return
            self._held_seq += 1
            self._hold(self._held_seq, frames, None)

    def _wait_offloaded(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the offloaded batch (draining), answering the direct
        socket meanwhile; whether the batch is done."""
        done = self._offload.done
        try:
            if self.direct_socket is None:
                return bool(done.poll(seconds * 1000.0))
            poller = zmq.Poller()
            poller.register(done, zmq.POLLIN)
            poller.register(self.direct_socket.sock, zmq.POLLIN)
            if self.direct_socket.link is not None:
                poller.register(self.direct_socket.link.fileno(), zmq.POLLIN)
            deadline = time.monotonic() + seconds
            link = self.direct_socket.link
            while True:
                if link is not None and link.inbox:  # read already: its descriptor will not tell
                    self._drain_direct()
                # Whole milliseconds, rounded up: truncated, the last fraction of one would
                # be a run of polls that do not wait.
                events = dict(poller.poll(math.ceil(max(0.0, deadline - time.monotonic()) * 1000.0)))
                if done in events:
                    return True
                if not events and time.monotonic() >= deadline:
                    return False
                self._drain_direct()
        finally:  # pyzmq's polls, on sockets a Waiter may watch (see wire.Waiter)
            touched(done)
            if self.direct_socket is not None:
                touched(self.direct_socket.sock)

    def _wait_direct(self, seconds: float) -> None:
        """Stopped: wait up to ``seconds``, answering the direct socket (503) meanwhile."""
        if self.direct_socket.wait(seconds * 1000.0):
            self._drain_direct()

    def _linger_direct(self) -> None:
        """Stopped with leases: until `_linger_until` (a heartbeat interval after the ends
        were sent), keep answering direct REQUESTs, so that one its client sent before it
        heard of the end gets its 503 instead of silence.  A second signal cuts it short."""
        if self.direct_socket is None:
            return
        while not (self._take_signals() and self.hurry.is_set()):
            if self._held:  # FINALs held for clients that were not reading: their last chance
                self._send_held()
            left = self._linger_until - time.monotonic()
            if left <= 0:
                break
            self._wait_direct(min(left, HELD_RETRY_S if self._held else 0.05))
        if self._held:
            log.warning("%d FINAL(s) held for leaseholders that were not reading are dropped: the worker stops",
                        len(self._held))

    # ------------------------------------------------------------------ keep-warm

    def _open_keep_warm(self):
        """The keep-warm decision and its unit: one batch of one of the model's example
        inputs (built here, once), run by the plane (`warm`) on the loop's thread while the
        worker is idle (gpu_worker.keepwarm.KeepWarm).  A model whose batch of one takes longer than
        KEEP_WARM_MAX_UNIT is not kept warm: a request that arrives during a unit waits for
        it, so a unit must be small."""
        from gpu_worker import keepwarm
        from gpu_worker.keepwarm import KeepWarm, keep_warm_period

        cfg = self.cfg
        period = keep_warm_period(cfg.keep_warm, self.cuda)
        off = KeepWarm(None, util=cfg.keep_warm_util)  # checks the setting even when off
        if period is None:
            return off
        why = seconds = None
        if self._streaming:
            why = "a streaming model is not kept warm"
        else:
            try:
                example = self.model.example_inputs()
            except NotImplementedError:
                why = "the model has no example_inputs()"
            except Exception as e:  # (it was a traceback and exit 1 at start: keep-warm is an optimisation)
                why = f"its example_inputs() raised {raised(e)}"
            else:
                misfit = self._examples_misfit()
                if misfit is not None:
                    why = f"its example_inputs() do not fit its declared inputs ({misfit})"
        if why is None:
            plane = self.plane

            def unit() -> None:
                # Through the plane: a CUDA plane runs it on the worker stream (on the loop
                # thread's default stream it was unordered with a device batch still queued;
                # found by reading, untested on a GPU).
                plane.warm(example)

            seconds = self.compute_times.predict(1)  # the warm-up's steady-state time
            if seconds is None:  # no warm-up ran: time the unit (its second run; the first pays lazy init)
                try:
                    unit()
                    t0 = time.perf_counter()
                    unit()
                    seconds = time.perf_counter() - t0
                except Exception as e:
                    why = f"its unit (a batch of one of the example inputs) raised {raised(e)}"
            if why is None and seconds > keepwarm.KEEP_WARM_MAX_UNIT:
                why = (f"a batch of one takes {seconds * 1e3:.3g} ms, over the {keepwarm.KEEP_WARM_MAX_UNIT * 1e3:g} ms "
                       "a unit may take (a request arriving during one would wait for it)")
        if why is not None:
            (log.info if cfg.keep_warm is None else log.warning)("keep-warm off for %s: %s", self.model.name, why)
            off.off_reason = why
            return off
        kw = KeepWarm(period, unit, util=cfg.keep_warm_util, max_unit=keepwarm.KEEP_WARM_MAX_UNIT)
        log.info("keep-warm on: a batch of one (%.3g ms) after %.3g ms without work, while the busy fraction "
                 "of the last %.3g s is at most %.0f%%", seconds * 1e3, period * 1e3, kw.window, kw.util * 100)
        return kw

    def _keep_warm_timeout(self, now: float, timeout: float) -> float:
        """The loop's poll timeout, shortened to when the next keep-warm unit is due (the
        Waiter sleeps a fraction of a millisecond as such: no rounding, no spinning)."""
        if self._busy or len(self.batcher) or not self.keep_warm.enabled:
            return timeout
        at = self.keep_warm.next_at(now)
        if at is None:
            return timeout
        return max(0.0, min(timeout, at - now))

    def _maybe_keep_warm(self) -> None:
        """Run a keep-warm unit if one is due and the worker is idle (nothing computing,
        nothing waiting in the batcher).  A request arriving meanwhile waits one unit."""
        if not self._busy and not len(self.batcher) and self.keep_warm.enabled:
            sock = self.sock
            if sock is not None and sock_events(sock) & _POLLIN:
                return  # work is waiting in the socket: it goes first
            if self.direct_socket is not None and self.direct_socket.has_message():
                return
            self.keep_warm.maybe_run(time.monotonic())
            end_forked_child()  # (a child the model forked in the unit ends there)

    @property
    def keep_warm_runs(self) -> int:
        """Keep-warm units run so far."""
        return self.keep_warm.runs

    @property
    def keep_warm_seconds(self) -> float:
        """Seconds the keep-warm units took, in all."""
        return self.keep_warm.seconds

    def stats(self) -> dict:
        """Counters, until the project has a metrics endpoint."""
        return {"served": self.served, "direct_sent": self.direct_sent, "leased_sent": self.leased_sent,
                "leased_bounced": self.leased_bounced,
                "keep_warm_runs": self.keep_warm.runs, "keep_warm_seconds": self.keep_warm.seconds}

    def _log_keep_warm(self) -> None:
        kw = getattr(self, "keep_warm", None)
        if kw is not None and (kw.runs or kw.enabled):
            log.info("keep-warm ran %d times, %.1f ms in all%s", kw.runs, kw.seconds * 1e3,
                     f" ({kw.failures} failed)" if kw.failures else "")


_END = object()  # the end of a streaming model's outputs


def _holds_message(sock) -> bool:
    return bool(sock_events(sock) & _POLLIN)


def _priority_name(body) -> tuple[str, dict]:
    """The priority a brokered request's header names ("urgent", "normal", "background"),
    and its attempt when it is a retry ("normal, attempt 1"), for a debug line, with the
    line's `extra=` (its rid and trace_id: every line about a request names it, the logs
    audit); "?" and none for a body that does not decode (the loop answers it later)."""
    try:
        req = P.decode_request(body[0], len(body) - 1, brokered=True)
        name = P.Priority(req.priority).name.lower()
    except Exception:
        return "?", {}
    return (name if req.attempt is None else f"{name}, attempt {req.attempt}"), logs.request_fields(req)


def _is_direct_request(frames) -> bool:
    """Whether frames read from the direct socket are a REQUEST: routing id, MDPC02, 0x01,
    service, body (at least one frame)."""
    return len(frames) >= 5 and bytes(frames[1]) == P.MDPC and bytes(frames[2]) == P.C_REQUEST


#: The signal handlers the worker installed (`ignore_other_signals`, `install_sigterm_drain`)
#: and its wakeup pipe's write end: what a process the model forks must not keep.
_OUR_HANDLERS: dict = {}
_WAKEUP_FD = [-1]


def _install(sig: int, handler) -> None:
    _OUR_HANDLERS[sig] = handler
    signal.signal(sig, handler)


def _after_fork_in_child() -> None:
    """In a process forked from the worker (a model's `os.fork()`, a `multiprocessing` pool
    with the fork start method): the signals as a plain Python process has them.  It
    inherited the worker's handlers, which only count a SIGTERM or SIGINT for a drain loop
    it does not run (and say SIGHUP, SIGUSR1 and SIGUSR2 are ignored), and the mask of the
    thread that forked (the compute thread blocks the stop signals): SIGTERM did nothing, so
    `Pool.terminate()`, a `with Pool()`'s exit and multiprocessing's own at exit, waited
    for its workers for good, and a helper stopped with SIGTERM ran on (the fork hunt)."""
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            if sig in _OUR_HANDLERS and signal.getsignal(sig) is _OUR_HANDLERS[sig]:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        if _WAKEUP_FD[0] >= 0:  # the child's signals are not the worker's loop's to hear
            fd = signal.set_wakeup_fd(-1)
            if fd != _WAKEUP_FD[0]:
                signal.set_wakeup_fd(fd)  # not ours: the model's own, put back
        logs.unblock_stop_signals()
    except (ValueError, OSError):  # (signal.signal outside the main thread: not after a fork)
        pass


#: Where the worker's own connections are (its broker's address, its direct socket's and
#: link's): unix paths and (ip, port) pairs, for `_close_our_connections`.
_OUR_ENDPOINTS: set = set()


def _own_endpoint(endpoint: str | None) -> None:
    """Note a zmq endpoint the worker connects to or binds (resolved now: not in a child)."""
    if not endpoint:
        return
    if endpoint.startswith("ipc://"):
        _OUR_ENDPOINTS.add(endpoint[len("ipc://"):])
    elif endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        try:
            for ai in socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM):
                _OUR_ENDPOINTS.add(tuple(ai[4][:2]))
        except (OSError, ValueError):
            pass
    else:  # a plain path (a link's)
        _OUR_ENDPOINTS.add(endpoint)


def _close_our_connections() -> None:
    """In a forked child: close its copies of the worker's connections (libzmq's
    descriptors: nothing in the child uses them).  Kept open, a helper the model forked
    during a batch held the worker's connection to its broker after the worker died: the
    broker, which hears a worker's crash from its connection closing, waited out the
    worker's heartbeat liveness instead (3 s by default) before it ran its requests
    elsewhere; and clients could still connect to a dead worker's direct socket."""
    if not _OUR_ENDPOINTS:
        return
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=fd)
        except (ValueError, OSError):
            continue
        try:
            ours = False
            for get in (s.getpeername, s.getsockname):
                try:
                    addr = get()
                except OSError:
                    continue
                if isinstance(addr, tuple):
                    addr = tuple(addr[:2])
                elif isinstance(addr, bytes):
                    addr = addr.decode("utf-8", "surrogateescape")
                if addr and addr in _OUR_ENDPOINTS:
                    ours = True
        finally:
            s.detach()
        if ours:
            try:
                os.close(fd)
            except OSError:
                pass


os.register_at_fork(after_in_child=_after_fork_in_child)
os.register_at_fork(after_in_child=_close_our_connections)


def ignore_other_signals() -> None:
    """SIGHUP, SIGUSR1 and SIGUSR2: a WARNING saying each is ignored, and the worker carries
    on.  Installed from the worker's start (`python -m gpu_worker` calls it before its model
    loads), not only once it serves: their default action ended a worker still loading or
    warming up its model at once, with no line on stderr."""
    # SIGHUP's default action ended the worker at once, with no drain (an operator who sent it
    # meant a launcher's rolling restart, or a terminal closed): said, and ignored.
    # Said through the log's writer thread (logs.warn_from_signal): written here, to a stderr
    # pipe nobody read, it blocked the loop for good, and the broker presumed the worker dead.
    _install(signal.SIGHUP, lambda *_: logs.warn_from_signal(
        "gpu_worker", "SIGHUP ignored (SIGTERM drains and stops a worker; SIGHUP to the launcher rolls its pools)"))
    # SIGUSR1 and SIGUSR2 (a logrotate habit): their default action ended the worker at once,
    # its batch lost and its requests retried elsewhere; logs go to stderr, nothing to reopen.
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        _install(sig, lambda n, _f: logs.warn_from_signal(
            "gpu_worker", f"{signal.Signals(n).name} ignored (logs go to stderr: there is no log file to reopen; "
                          "SIGTERM drains and stops a worker)"))


def install_sigterm_drain(worker: Worker) -> None:
    """SIGTERM or SIGINT: finish what is held, DISCONNECT, keep outputs readable until they
    are released (or the grace passes); a second signal skips that wait."""

    def on_signal(*_) -> None:
        # Nothing that takes a lock: a second signal may arrive while this handler, or the
        # loop, is inside an Event's lock (a deadlock, seen with a SIGKILLed launcher).
        worker.signals += 1

    _install(signal.SIGTERM, on_signal)
    _install(signal.SIGINT, on_signal)
    ignore_other_signals()
    # The interpreter runs `on_signal` only once the loop's wait returns (PEP 475 restarts
    # it after EINTR, timeout and all): the C-level handler also writes the signal's number
    # to this pipe, which the loop watches (`Worker.signal_fd`).
    pipe = logs.signal_wakeup_pipe()
    if pipe is not None:  # (None: not the main thread; the loop notices at its next wake-up)
        worker.signal_fd, _WAKEUP_FD[0] = pipe
