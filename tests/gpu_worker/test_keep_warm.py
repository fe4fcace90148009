"""Keep-warm (issue 14 item 3): the trigger as pure arithmetic on times passed in, and a real
Worker serving in process (its upstream an inproc pair to the test): units run while it is
idle, never while it is off (the CPU default), and a request that arrives during a unit
waits for that one unit only."""
from __future__ import annotations

import itertools
import logging
import threading
import time

import numpy as np
import pytest
import zmq

from broker import protocol as P
from broker.protocol.wire import send_frames
from gpu_worker import keepwarm as cuda_runtime  # the keep-warm constants live there
from gpu_worker.keepwarm import KEEP_WARM_AUTO_PERIOD, KEEP_WARM_SLOW_UNITS, KeepWarm, keep_warm_period
from gpu_worker.worker import Worker, WorkerConfig

pytestmark = pytest.mark.timeout(30)


class Clock:
    """Seconds that pass only when told; a unit "takes" `unit` seconds of it."""

    def __init__(self, t: float = 0.0, unit: float = 0.002):
        self.t = t
        self.unit = unit

    def __call__(self) -> float:
        return self.t

    def warm(self) -> None:
        self.t += self.unit


def _keep_warm(period=0.1, **kw) -> tuple[KeepWarm, Clock]:
    clock = Clock()
    return KeepWarm(period, clock.warm, clock=clock, timer=clock, **kw), clock


# ------------------------------------------------------------------------------ the trigger

def test_an_idle_worker_runs_one_unit_per_period():
    k, clock = _keep_warm(0.1)
    assert not k.due(0.099) and k.next_at(0.0) == pytest.approx(0.1)
    clock.t = 0.1
    assert k.maybe_run(0.1) and k.runs == 1 and k.seconds == pytest.approx(0.002)
    assert not k.maybe_run(clock.t)                       # not again at once: a period after its end
    assert k.next_at(clock.t) == pytest.approx(0.202)
    clock.t = 0.202
    assert k.maybe_run(clock.t) and k.runs == 2


def test_a_real_batch_restarts_the_idle_clock_and_counts_at_its_end():
    k, _ = _keep_warm(0.1)
    k.busy(0.05, now=5.0)                                 # a batch that ended at 5.0
    assert not k.due(5.09)
    assert k.next_at(5.0) == pytest.approx(5.1) and k.due(5.1)
    # Traffic with gaps shorter than the period: never due in a gap.
    for i in range(20):
        end = 5.0 + 0.05 * (i + 1)
        k.busy(0.01, now=end)
        assert not k.due(end + 0.04)


def test_utilisation_above_the_threshold_holds_units_back():
    k, _ = _keep_warm(0.1, util=0.6, window=1.0)
    k.busy(0.9, now=1.0)                                  # busy 0.1 .. 1.0
    assert k.utilisation(1.1) == pytest.approx(0.9)
    assert not k.due(1.1)                                 # a period passed, but 90% busy
    # The window must slide past 0.3 s of that batch: busy 0.6 of the window at 1.4.
    assert k.next_at(1.1) == pytest.approx(1.4)
    assert not k.due(1.39) and k.due(1.4) and k.utilisation(1.4) == pytest.approx(0.6)


def test_low_utilisation_lets_units_in_between_sparse_batches():
    k, _ = _keep_warm(0.1, util=0.6, window=1.0)
    for i in range(10):                                   # 50% busy: 50 ms batches every 100 ms
        k.busy(0.05, now=0.1 * (i + 1))
    assert k.utilisation(1.0) == pytest.approx(0.5)
    assert k.next_at(1.0) == pytest.approx(1.1) and k.due(1.1)


def test_util_one_and_zero():
    always, _ = _keep_warm(0.1, util=1.0, window=1.0)
    always.busy(0.9, now=1.0)
    assert always.next_at(1.0) == pytest.approx(1.1)      # the idle period alone
    only_idle, _ = _keep_warm(0.1, util=0.0, window=1.0)
    only_idle.busy(0.01, now=1.0)
    assert only_idle.next_at(1.0) == pytest.approx(1.1)   # no earlier than the period: ask again then
    assert only_idle.next_at(1.1) == pytest.approx(2.0)   # once no real work is left in the window
    assert not only_idle.due(1.99) and only_idle.due(2.0)


def test_off_and_the_auto_period():
    for off in (KeepWarm(None, lambda: 1 / 0), KeepWarm(0, lambda: 1 / 0), KeepWarm(0.1)):
        assert not off.enabled and not off.maybe_run(now=1e9)
    assert KeepWarm(0).next_at(1.0) is None
    assert keep_warm_period(None, cuda=True) == KEEP_WARM_AUTO_PERIOD == 0.05
    assert keep_warm_period(None, cuda=False) is None
    assert keep_warm_period(0, cuda=True) is None
    assert keep_warm_period(0.02, cuda=False) == 0.02
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError):
            KeepWarm(0.1, util=bad)


def test_a_failing_unit_is_logged_once_and_never_raised(caplog):
    clock = Clock()

    def boom():
        raise RuntimeError("no")

    k = KeepWarm(0.1, boom, clock=clock, timer=clock)
    with caplog.at_level(logging.WARNING, logger="gpu_worker.cuda"):
        for t in (0.1, 0.2, 0.3):
            assert k.maybe_run(t)
    assert k.runs == 3 and k.failures == 3
    assert len([r for r in caplog.records if "keep-warm unit failed" in r.getMessage()]) == 1


def test_slow_units_turn_keep_warm_off(caplog):
    k, clock = _keep_warm(0.1, max_unit=0.001)            # each unit takes 2 ms
    t = 0.0
    with caplog.at_level(logging.WARNING, logger="gpu_worker.cuda"):
        for _ in range(KEEP_WARM_SLOW_UNITS):
            t = k.next_at(clock.t)
            clock.t = t
            assert k.maybe_run(t)
    assert not k.enabled and k.next_at(t + 10) is None and "longer than" in k.off_reason
    assert any("keep-warm off" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------ a real worker

class _Pipe:
    """The worker's upstream: an inproc PAIR whose other end (`peer`) is the test.  Records
    when each message was sent, on the worker's side."""

    watch_liveness = False
    monitor = None

    def __init__(self, ctx: zmq.Context, name: str):
        self.ctx = ctx
        self.addr = f"inproc://{name}"
        self.peer = ctx.socket(zmq.PAIR)
        self.peer.linger = 0
        self.peer.bind(self.addr)
        self.sock: zmq.Socket | None = None
        self.last_sent = 0.0
        self.finals_at: list[float] = []

    def connect(self, service, ready) -> zmq.Socket:
        if self.sock is not None:
            self.sock.close()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.linger = 0
        self.sock.connect(self.addr)
        self.send(P.worker_ready(service, ready))
        return self.sock

    def receive(self, frames):
        return P.parse_broker_to_worker(frames)

    def send(self, frames) -> None:
        if bytes(frames[1]) == P.W_FINAL:
            self.finals_at.append(time.monotonic())
        send_frames(self.sock, frames)
        self.last_sent = time.monotonic()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.peer.close()

    # the test's side

    def request(self, rid: int) -> None:
        x = np.arange(16, dtype=np.float32) + rid
        head = P.encode_header(P.Request(id=rid, reply="inline",
                                         tensors=[P.TensorRef("x", "<f4", [16], P.InlineLoc(frame=0))]))
        self.peer.send_multipart([P.MDPW, P.W_REQUEST, P.token_envelope(rid), b"", head, x.tobytes()])

    def next(self, command: bytes, timeout: float = 5.0) -> list[bytes]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.peer.poll(left * 1000), f"no {command!r} from the worker in {timeout} s"
            frames = self.peer.recv_multipart()
            if frames[1] == command:
                return frames


class _Units:
    """Wraps a worker's keep-warm unit: counts the units (a condition the test waits on) and
    notes, at each start, whether any request was pending in the worker."""

    def __init__(self, worker: Worker, hold: float = 0.0):
        self.worker = worker
        self.real = worker.keep_warm.warm
        self.hold = hold            # extra seconds each unit lasts (a unit of known length)
        self.cv = threading.Condition()
        self.starts: list[tuple[float, int]] = []
        worker.keep_warm.warm = self

    def __call__(self) -> None:
        with self.cv:
            self.starts.append((time.monotonic(), len(self.worker.jobs) + len(self.worker.batcher)))
            self.cv.notify_all()
        self.real()
        if self.hold:
            threading.Event().wait(self.hold)  # the unit's own length, not a synchronisation

    def wait(self, n: int, timeout: float = 5.0) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.starts) >= n, timeout), f"fewer than {n} keep-warm units"


_NAMES = itertools.count()  # inproc names (not id(tmp_path): a closed one's may be held yet)


@pytest.fixture
def serving(tmp_path):
    """start(hold=..., **config) -> (worker, pipe, units): a CPU echo worker serving in a thread."""
    running = []

    def start(hold: float = 0.0, **kw):
        pipe = _Pipe(zmq.Context.instance(), f"keep-warm-{next(_NAMES)}")
        cfg = dict(broker="inproc://unused", model="echo", device="cpu", transports=("inline",),
                   heartbeat_interval=0.05, credit=4)
        cfg.update(kw)
        w = Worker(WorkerConfig(**cfg), upstream=pipe)
        units = _Units(w, hold) if w.keep_warm.enabled else None
        t = threading.Thread(target=w.serve, name="worker", daemon=True)
        running.append((w, t))
        t.start()
        return w, pipe, units

    try:
        yield start
    finally:
        for w, t in running:
            w.stop.set()
            t.join(10)
            assert not t.is_alive()
            w.close()


def _batch_wait_ms(final: list[bytes]) -> float:
    return P.decode_reply(final[4]).timing["batch_wait_ms"]


def test_an_idle_worker_keeps_warm_and_counts_it(serving, caplog):
    period = 0.01
    w, _, units = serving(keep_warm=period)
    assert w.keep_warm.enabled and w.keep_warm.period == period
    units.wait(4)
    starts = [t for t, _ in units.starts[:4]]
    assert all(b - a >= period * 0.9 for a, b in zip(starts, starts[1:])), starts  # spaced, not back to back
    stats = w.stats()
    assert stats["keep_warm_runs"] >= 3 and stats["keep_warm_seconds"] > 0
    assert set(stats) >= {"served", "direct_sent", "keep_warm_runs", "keep_warm_seconds"}
    assert w.keep_warm_runs == w.keep_warm.runs
    with caplog.at_level(logging.INFO, logger="gpu_worker"):
        w._log_keep_warm()
    assert any("keep-warm ran" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("setting", [None, 0])
def test_off_on_the_cpu_by_default_and_at_zero(serving, setting):
    w, pipe, units = serving(keep_warm=setting)
    assert units is None and not w.keep_warm.enabled
    for _ in range(3):  # three heartbeat intervals of an idle loop
        pipe.next(P.W_HEARTBEAT)
    assert w.stats()["keep_warm_runs"] == 0 and w.keep_warm_seconds == 0


def test_a_request_during_a_unit_waits_for_that_unit_only(serving):
    unit = 0.02
    w, pipe, units = serving(keep_warm=0.2, hold=unit)
    units.wait(1)                                # a unit has started (and lasts `unit` s)
    sent = time.monotonic()
    pipe.request(1)
    final = pipe.next(P.W_FINAL)
    answered = pipe.finals_at[0]
    assert P.decode_reply(final[4]).id == 1
    assert _batch_wait_ms(final) < unit * 1e3    # read after the unit, then run at once
    assert not [t for t, _ in units.starts if sent < t < answered], "a second unit ran before the request"
    assert answered - sent < unit + 0.5          # one unit (and a generous bound for a busy machine)
    assert all(pending == 0 for _, pending in units.starts)


def test_requests_between_units_are_never_held_for_one(serving):
    """Units every 5 ms, requests in between: each is read and run at once (its batch wait
    under one unit), and from its send to its FINAL it waits at most for the one unit that
    may have started as it was sent (units are never longer than KEEP_WARM_MAX_UNIT), not
    for units run back to back while it sits in the socket."""
    unit = cuda_runtime.KEEP_WARM_MAX_UNIT
    _, pipe, units = serving(keep_warm=0.005)
    for i in range(5):
        units.wait(i + 1)
        sent = time.monotonic()
        pipe.request(i)
        final = pipe.next(P.W_FINAL)
        answered = pipe.finals_at[i]
        assert P.decode_reply(final[4]).id == i
        assert _batch_wait_ms(final) < unit * 1e3
        during = [t for t, _ in units.starts if sent < t < answered]
        assert len(during) <= 1, f"request {i}: {len(during)} units started while it waited"
        assert answered - sent < unit + 0.25, f"request {i}: {answered - sent:.3f} s from send to FINAL"
    assert all(pending == 0 for _, pending in units.starts)  # never while a request was pending


def test_a_model_slower_than_a_unit_may_be_is_not_kept_warm(monkeypatch, caplog):
    monkeypatch.setattr(cuda_runtime, "KEEP_WARM_MAX_UNIT", 0.0)  # any batch of one is too slow
    with caplog.at_level(logging.WARNING, logger="gpu_worker"):
        w = Worker(WorkerConfig(broker="inproc://unused", model="echo", device="cpu", transports=("inline",),
                                keep_warm=0.01), upstream=_Pipe(zmq.Context.instance(), "keep-warm-slow"))
    try:
        assert not w.keep_warm.enabled and "a unit may take" in w.keep_warm.off_reason
        assert any("keep-warm off" in r.getMessage() for r in caplog.records)
    finally:
        w.close()


def test_a_streaming_model_is_not_kept_warm():
    w = Worker(WorkerConfig(broker="inproc://unused", model="chunks", device="cpu", transports=("inline",),
                            keep_warm=0.01), upstream=_Pipe(zmq.Context.instance(), "keep-warm-stream"))
    try:
        assert not w.keep_warm.enabled and "streaming" in w.keep_warm.off_reason
    finally:
        w.close()


def test_a_unit_runs_through_the_data_plane():
    """The unit is the plane's `warm` (a CUDA plane queues it on the worker stream, with the
    device batches), not `backend.run` called by the worker on the loop thread's default
    stream, unordered with a device batch still queued.  (Before: `warm` was never called.)"""
    w = Worker(WorkerConfig(broker="inproc://unused", model="echo", device="cpu", transports=("inline",),
                            keep_warm=0.01), upstream=_Pipe(zmq.Context.instance(), "keep-warm-plane"))
    try:
        assert w.keep_warm.enabled
        seen = []
        w.plane.warm = lambda inputs: seen.append(sorted(inputs))
        w.keep_warm.warm()
        assert seen == [sorted(w.model.example_inputs())]
    finally:
        w.close()
