"""broker.metrics (what the broker counts, and the Prometheus text of a scrape) and broker.http
(the HTTP threads, asking a stand-in for the broker loop over the inproc PAIR), in process.
The end-to-end counts against real traffic are tests/e2e/test_metrics.py."""
from __future__ import annotations

import itertools
import json
import math
import socket
import threading
import urllib.error
import urllib.request

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from broker import protocol as P
from broker.http import MAX_CONNECTIONS, HttpFront, LoopLink, parse_address
from broker.metrics import CLIENT_GONE, MAX_SERVICES, OTHER, OUTCOMES, Metrics, exposition, outcome_name, render
from broker.protocol.stats import BATCH_BUCKETS, LATENCY_BUCKETS

pytestmark = pytest.mark.timeout(30)


def _sched(services: dict) -> dict:
    return {"services": {name: {"queued": {"urgent": 0, "normal": q, "background": 0}, "in_flight": f,
                                "workers": 1, "credit": 4, "hosts": {"h": 1}}
                         for name, (q, f) in services.items()},
            "counters": {"dispatched": 3}}


def _samples(text: bytes) -> list:
    out = []
    for fam in text_string_to_metric_families(text.decode()):
        out += [(s.name, tuple(sorted(s.labels.items())), s.value) for s in fam.samples]
    return out


def test_outcome_names_are_bounded():
    assert outcome_name(0) == "ok"
    assert outcome_name(int(P.ErrorCode.QUEUE_FULL)) == "queue_full"
    assert outcome_name(CLIENT_GONE) == "client_gone"
    assert {outcome_name(c) for c in (7, -5, 1 << 62, 600)} == {"error_other"}


def test_counts_labels_and_one_series_per_label_set():
    m = Metrics()
    m.register("echo", 0.0)
    m.final("echo", 0, 1.0, 1.001, 1.004)
    m.final("echo", int(P.ErrorCode.DEADLINE_EXCEEDED), 1.0, None, 2.0)
    m.final("nobody", int(P.ErrorCode.SERVICE_UNAVAILABLE), 1.0, None, 2.0)
    m.final("junk", 0, None, None, 2.0)  # refused at admission: no times
    # Two unregistered names in the scheduler add up under one _other series.
    text = exposition(render(m.snapshot(), _sched({"echo": (2, 1), "x": (1, 0), "y": (3, 2)}), m.known))
    samples = _samples(text)
    keys = [(n, lab) for n, lab, _ in samples]
    assert len(keys) == len(set(keys)), "duplicate series"
    got = {(n, lab): v for n, lab, v in samples}
    assert got[("zmq_infer_queue_depth", (("priority", "normal"), ("service", OTHER)))] == 4
    assert got[("zmq_infer_in_flight", (("service", OTHER),))] == 2
    assert got[("zmq_infer_requests_total", (("outcome", "ok"), ("service", "echo")))] == 1
    assert got[("zmq_infer_requests_total", (("outcome", "deadline_exceeded"), ("service", "echo")))] == 1
    assert got[("zmq_infer_requests_total", (("outcome", "service_unavailable"), ("service", OTHER)))] == 1
    # Results alone in the latency histogram: the expiry is an outcome, not a fast answer.
    assert got[("zmq_infer_request_seconds_count", (("service", "echo"),))] == 1
    assert got[("zmq_infer_queue_wait_seconds_count", (("service", "echo"),))] == 1
    assert got[("zmq_infer_broker_events_total", (("event", "dispatched"),))] == 3


def test_a_known_service_the_scheduler_forgot_keeps_its_gauges_at_zero():
    """docs/operations.md: a service's series go when its label is retired (10 minutes
    without a worker); its gauges went with its last worker (the scheduler forgets it), so
    `zmq_infer_workers == 0` never matched."""
    m = Metrics()
    m.register("echo", 0.0)
    m.register("gone", 0.0)
    got = {(n, lab): v for n, lab, v in _samples(exposition(render(m.snapshot(), _sched({"echo": (1, 1)}), m.known)))}
    assert got[("zmq_infer_workers", (("host", "h"), ("service", "echo")))] == 1
    assert got[("zmq_infer_workers", (("host", ""), ("service", "gone")))] == 0  # (Prometheus: no host label)
    for name in ("zmq_infer_in_flight", "zmq_infer_credit", "zmq_infer_leases", "zmq_infer_leased_credit"):
        assert got[(name, (("service", "gone"),))] == 0
    for pri in ("urgent", "normal", "background"):
        assert got[("zmq_infer_queue_depth", (("priority", pri), ("service", "gone")))] == 0
    assert not any(lab == (("service", "echo"),) and n == "zmq_infer_workers" for n, lab in got)


def test_service_labels_are_capped():
    m = Metrics()
    for i in range(MAX_SERVICES + 10):
        m.register(f"s{i}", 0.0)
    assert len(m.known) == MAX_SERVICES and m.label(f"s{MAX_SERVICES + 5}") == OTHER


def test_a_registered_service_has_every_outcome_at_zero_before_any_request():
    """The series exist from the registration: a dashboard's `label_values(zmq_infer_requests_total,
    service)` lists a service nobody has called yet, and the first request of an outcome is an
    increase from 0 that rate() sees (a series that appears at 1 has none).  Bounded as the
    labels are: a name past the cap gets no series of its own; a retired one loses them."""
    assert set(OUTCOMES) == {"ok", "client_gone", "error_other"} | {c.name.lower() for c in P.ErrorCode}
    assert {outcome_name(c) for c in (0, CLIENT_GONE, 7, *map(int, P.ErrorCode))} == set(OUTCOMES)
    m = Metrics()
    m.register("idle", 0.0)
    got = {(n, lab): v for n, lab, v in _samples(exposition(render(m.snapshot(), _sched({}), m.known)))}
    for outcome in OUTCOMES:
        assert got[("zmq_infer_requests_total", (("outcome", outcome), ("service", "idle")))] == 0
    assert got[("zmq_infer_queue_wait_seconds_count", (("service", "idle"),))] == 0
    assert not any(dict(lab).get("service") == OTHER for _n, lab in got)  # nothing counted there
    m.final("idle", 0, 1.0, 1.0, 1.001)
    m.register("idle", 2.0)  # its worker registers again: the counts stay
    got = {(n, lab): v for n, lab, v in _samples(exposition(render(m.snapshot(), _sched({}), m.known)))}
    assert got[("zmq_infer_requests_total", (("outcome", "ok"), ("service", "idle")))] == 1
    # The cap: a name past it has no series; requests for it count under _other.
    capped = Metrics()
    for i in range(MAX_SERVICES + 3):
        capped.register(f"s{i}", 0.0)
    assert len(capped.services) == MAX_SERVICES and f"s{MAX_SERVICES + 1}" not in capped.services
    # Retired (10 minutes without a worker): its series go with its label.
    m.sweep(lambda name: False, 10.0)
    m.sweep(lambda name: False, 10.0 + 601.0)
    assert "idle" not in m.known and "idle" not in m.services


def _stats(**kw):
    base = dict(compute=([1] + [0] * len(LATENCY_BUCKETS), 0.00005),
                batch=([2] + [0] * len(BATCH_BUCKETS), 2.0), shm_used=10, shm_capacity=100)
    base.update(kw)
    return P.WorkerStats(**base)


@pytest.mark.parametrize("bad", [
    {"compute": ([1] * 3, 1.0)},                                       # other bounds
    {"compute": ([-1] + [0] * len(LATENCY_BUCKETS), 1.0)},             # negative count
    {"compute": ([1] + [0] * len(LATENCY_BUCKETS), math.nan)},         # NaN sum
    {"compute": ([1] + [0] * len(LATENCY_BUCKETS), math.inf)},
    {"compute": ([1 << 60] + [0] * len(LATENCY_BUCKETS), 1.0)},        # absurd
    {"shm_used": -5},
    {"keep_warm_runs": -1},
    {"leased": {0: -1}},                                               # negative leased count
    {"leased": {0: 1 << 60}},
    {"leased": {c: 1 for c in range(100)}},                            # more codes than any version has
    {"leased_request": ([1] * 3, 1.0)},
    {"leased_request": ([1] + [0] * len(LATENCY_BUCKETS), -1.0)},
    {"leased_dropped": -1},
    {"leased_dropped": 1 << 60},
])
def test_stats_that_do_not_add_up_change_nothing(bad):
    m = Metrics()
    m.register("echo", 0.0)
    assert m.worker_stats(b"w", "echo", "1@h", _stats())
    before = exposition(render(m.snapshot(), _sched({}), m.known))
    assert not m.worker_stats(b"w", "echo", "1@h", _stats(**bad))
    assert m.bad_stats == 1
    assert exposition(render(m.snapshot(), _sched({}), m.known)) == before
    assert "nan" not in before.decode().lower()


def test_gauges_of_workers_that_are_gone_are_dropped():
    m = Metrics()
    m.register("echo", 0.0)
    m.worker_stats(b"w1", "echo", "1@h", _stats())
    m.worker_stats(b"w2", "echo", "1@other", _stats(shm_used=20))
    text = exposition(render(m.snapshot(alive=lambda w: w == b"w2"), _sched({}), m.known)).decode()
    assert 'worker="1@other"' in text and 'worker="1@h"' not in text
    assert list(m.gauges) == [b"w2"]
    # Without a scrape too: the broker's housekeeping prunes them once a second.
    m.worker_stats(b"w3", "echo", "2@h", _stats())
    m.prune(lambda w: w != b"w3")
    assert list(m.gauges) == [b"w2"]


def test_parse_address():
    assert parse_address("8002") == ("127.0.0.1", 8002)
    assert parse_address("0.0.0.0:9") == ("0.0.0.0", 9)
    assert parse_address("[::1]:9") == ("::1", 9)
    for bad in ("x", "1:99999"):
        with pytest.raises(ValueError):
            parse_address(bad)


_LOOPS = itertools.count()


class _Loop:
    """Stands in for the broker loop: answers the HTTP threads' questions from a dict, or
    not at all while `stuck`."""

    def __init__(self, answers: dict):
        self.ctx = zmq.Context.instance()
        self.addr = f"inproc://test-http-{next(_LOOPS)}"  # not id(self): a closed one's may be held yet
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.linger = 0
        self.sock.bind(self.addr)
        self.answers = answers
        self.link = LoopLink(self.ctx, self.addr)  # the HTTP threads' side (the broker's `_http_link`)
        self.stuck = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            if not self.sock.poll(20) or self.stuck.is_set():
                self.stop.wait(0.01)  # stuck: the question waits in the socket
                continue
            n, what, arg = self.sock.recv_pyobj()
            a = self.answers.get(what)
            self.link.answer(self.sock, n, a(arg) if callable(a) else a)

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)


def test_a_broker_at_a_closed_ones_address_opens_its_http_endpoint(tmp_path, monkeypatch):
    """The loop's inproc PAIR for the HTTP threads has a name of its own in the process.  It
    was id(self): a closed Broker's successor often has its address, and libzmq's reaper
    thread frees a closed socket's inproc name only later (Address already in use).  Every
    object here has "the same address", so the name must not come from it."""
    import broker.server as S

    monkeypatch.setattr(S, "id", lambda obj: 1, raising=False)

    def cfg(n):
        return S.BrokerConfig(frontend=f"ipc://{tmp_path}/fe{n}.ipc", backend=f"ipc://{tmp_path}/be{n}.ipc",
                              http="127.0.0.1:0")

    with S.Broker(cfg(1)) as a, S.Broker(cfg(2)) as b:
        assert a.http_address != b.http_address


@pytest.fixture
def front():
    m = Metrics()
    m.register("echo", 0.0)
    m.final("echo", 0, 1.0, 1.0, 1.5)
    answers = {
        "ready": True,
        "model_ready": lambda s: {"echo": "ready", "gone": "unavailable"}.get(s, "unknown"),
        "model": lambda s: {"name": s, "ready": True, "workers": []} if s == "echo" else {},
        "metrics": (m.snapshot(), _sched({"echo": (0, 0)}), list(m.known)),
    }
    loop = _Loop(answers)
    alive = {"ok": True}
    f = HttpFront(("127.0.0.1", 0), loop.link, alive=lambda: alive["ok"])
    f.loop, f.alive_flag = loop, alive
    try:
        yield f
    finally:
        f.close()
        loop.close()


def _get(f, path):
    url = "http://%s:%d%s" % (*f.address, path)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_paths_and_their_answers(front):
    assert _get(front, "/v2/health/live")[0] == 200
    assert _get(front, "/v2/health/ready")[0] == 200
    assert _get(front, "/v2/models/echo/ready")[0] == 200
    assert _get(front, "/v2/models/gone/ready")[0] == 503
    assert _get(front, "/v2/models/nope/ready")[0] == 404
    status, body = _get(front, "/v2/models/echo")
    assert status == 200 and json.loads(body)["name"] == "echo"
    assert _get(front, "/v2/models/nope")[0] == 404
    assert _get(front, "/nothing")[0] == 404
    status, body = _get(front, "/metrics")
    assert status == 200 and b'zmq_infer_requests_total{outcome="ok",service="echo"} 1.0' in body
    front.alive_flag["ok"] = False
    assert _get(front, "/v2/health/live")[0] == 503


def test_a_stuck_loop_gives_503_but_liveness_reads_the_loop_stamp(front):
    front.loop.stuck.set()
    assert _get(front, "/metrics")[0] == 503          # asked, no answer within a second
    assert _get(front, "/v2/health/live")[0] == 200   # the stamp (here: a flag) says alive
    front.loop.stuck.clear()
    # A late answer to the timed-out question is skipped, not taken for the next one.
    assert _get(front, "/v2/health/ready")[0] == 200
    assert _get(front, "/v2/models/echo/ready")[0] == 200


def test_connections_are_capped_and_the_oldest_makes_room(front):
    """16 clients that connect and say nothing cannot lock the probes out: a new connection
    evicts the oldest."""
    idle = []
    try:
        for _ in range(MAX_CONNECTIONS):
            idle.append(socket.create_connection(front.address, timeout=5))
        assert _get(front, "/v2/health/live")[0] == 200   # served: the oldest idle one went
        idle[0].settimeout(5)
        try:
            assert idle[0].recv(100) == b""                # closed by the server
        except ConnectionResetError:
            pass
    finally:
        for s in idle:
            s.close()
    assert _get(front, "/v2/health/ready")[0] == 200


def test_an_ipv6_address_is_served_and_named_in_brackets():
    from broker.http import host_port

    assert host_port("::1", 80) == "[::1]:80" and host_port("127.0.0.1", 80) == "127.0.0.1:80"
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    loop = _Loop({})
    try:
        f = HttpFront(("::1", 0), loop.link)
    except OSError as e:
        loop.close()
        pytest.skip(f"cannot bind ::1 here: {e}")
    try:
        with urllib.request.urlopen("http://%s/v2/health/live" % host_port(*f.address), timeout=10) as r:
            assert r.status == 200
    finally:
        f.close()
        loop.close()


def test_leases_are_gauges_per_service():
    m = Metrics()
    m.register("echo", 0.0)
    sched = _sched({"echo": (0, 1)})
    sched["services"]["echo"].update(leases=2, leased_credit=5)
    got = {(n, lab): v for n, lab, v in _samples(exposition(render(m.snapshot(), sched, m.known)))}
    assert got[("zmq_infer_leases", (("service", "echo"),))] == 2
    assert got[("zmq_infer_leased_credit", (("service", "echo"),))] == 5


def test_leased_requests_count_from_stats_as_outcomes_and_request_times():
    """Pinned requests never cross the broker: the worker's STATS carries their outcomes and
    receipt-to-FINAL times, which add to the same series as brokered requests."""
    m = Metrics()
    m.register("echo", 0.0)
    m.final("echo", 0, 1.0, 1.001, 1.004)  # one brokered
    leased_request = ([3] + [0] * (len(LATENCY_BUCKETS) - 1) + [1], 0.0003 + 99.0)
    leased = {0: 5, int(P.ErrorCode.QUEUE_FULL): 1, 999: 2, -3: 1, P.LEASED_CLIENT_GONE: 2}
    st = _stats(leased=leased, leased_request=leased_request)
    # Through the wire, as a worker sends it.
    st = P.parse_worker(P.worker_stats(st)).info
    assert st.leased == leased
    assert m.worker_stats(b"w", "echo", "1@h", st)
    got = {(n, lab): v for n, lab, v in _samples(exposition(render(m.snapshot(), _sched({}), m.known)))}
    assert got[("zmq_infer_requests_total", (("outcome", "ok"), ("service", "echo")))] == 6
    assert got[("zmq_infer_requests_total", (("outcome", "queue_full"), ("service", "echo")))] == 1
    assert got[("zmq_infer_requests_total", (("outcome", "error_other"), ("service", "echo")))] == 3
    # A leased request that did not run, its client gone: as a brokered one whose client left.
    assert got[("zmq_infer_requests_total", (("outcome", "client_gone"), ("service", "echo")))] == 2
    assert got[("zmq_infer_request_seconds_count", (("service", "echo"),))] == 1 + 4
    assert got[("zmq_infer_request_seconds_bucket", (("le", "+Inf"), ("service", "echo")))] == 5


def test_cuda_pool_and_gpu_memory_gauges_per_worker():
    """A CUDA worker's STATS carry its device pool's use and capacity and the device's memory
    (gpu_worker.cuda_plane.CudaPlane.usage): one gauge series each, labelled with the worker;
    a CPU worker's (None: not applicable) shows none of them."""
    m = Metrics()
    m.register("gpu", 0.0)
    st = _stats(cuda_used=3 << 20, cuda_capacity=256 << 20, device_used=5 << 30, device_total=80 << 30)
    st = P.parse_worker(P.worker_stats(st)).info  # through the wire, as a worker sends it
    assert m.worker_stats(b"w1", "gpu", "41@h", st)
    assert m.worker_stats(b"w2", "gpu", "42@h", _stats())  # a CPU worker: no device fields
    got = {(n, lab): v for n, lab, v in _samples(exposition(render(m.snapshot(), _sched({}), m.known)))}
    w1 = (("service", "gpu"), ("worker", "41@h"))
    assert got[("zmq_infer_cuda_pool_used_bytes", w1)] == 3 << 20
    assert got[("zmq_infer_cuda_pool_capacity_bytes", w1)] == 256 << 20
    assert got[("zmq_infer_gpu_memory_used_bytes", w1)] == 5 << 30
    assert got[("zmq_infer_gpu_memory_total_bytes", w1)] == 80 << 30
    assert got[("zmq_infer_shm_pool_used_bytes", w1)] == 10  # the host ring beside it
    w2 = (("service", "gpu"), ("worker", "42@h"))
    assert got[("zmq_infer_shm_pool_used_bytes", w2)] == 10
    assert not [k for k in got if k[1] == w2 and k[0].startswith(("zmq_infer_cuda_pool_", "zmq_infer_gpu_memory_"))]
    # The next STATS replaces the gauges (they are current values, not sums).
    assert m.worker_stats(b"w1", "gpu", "41@h", _stats(cuda_used=1 << 20, cuda_capacity=256 << 20,
                                                          device_used=4 << 30, device_total=80 << 30))
    got = {(n, lab): v for n, lab, v in _samples(exposition(render(m.snapshot(), _sched({}), m.known)))}
    assert got[("zmq_infer_cuda_pool_used_bytes", w1)] == 1 << 20
    assert got[("zmq_infer_gpu_memory_used_bytes", w1)] == 4 << 30
    # A worker that goes takes its device series with it.
    m.worker_gone(b"w1")
    text = exposition(render(m.snapshot(), _sched({}), m.known)).decode()
    assert 'worker="41@h"' not in text


@pytest.mark.parametrize("field", ["cuda_used", "cuda_capacity", "device_used", "device_total"])
def test_device_gauges_out_of_range_are_refused(field):
    m = Metrics()
    m.register("gpu", 0.0)
    assert not m.worker_stats(b"w", "gpu", "1@h", _stats(**{field: -1}))
    assert not m.worker_stats(b"w", "gpu", "1@h", _stats(**{field: 1 << 60}))
    assert m.bad_stats == 2 and m.gauges == {}


def test_frames_leased_streams_dropped_add_to_the_services_dropped_frames():
    # A pinned latest-wins stream's requests go straight to the worker: the frames its
    # client dropped were never counted (the broker reads them from brokered requests only).
    m = Metrics()
    m.register("echo", 0.0)
    m.dropped("echo", 3)  # brokered
    assert m.worker_stats(b"w", "echo", "1@h", _stats(leased_dropped=4))
    assert m._svc("echo").dropped == 7


# ---- the writer: byte for byte what prometheus-client writes, faster

from hypothesis import given, settings, strategies as st  # noqa: E402

from broker.metrics import Family, reference  # noqa: E402
from broker.protocol.stats import Histogram  # noqa: E402

_label_values = st.text(min_size=0, max_size=12)  # quotes, backslashes, newlines, any unicode
_numbers = st.one_of(st.integers(min_value=0, max_value=1 << 60), st.floats(allow_nan=True, allow_infinity=True),
                     st.integers(min_value=-(1 << 40), max_value=-1))


@st.composite
def _histograms(draw, bounds):
    h = Histogram(bounds)
    h.counts = draw(st.lists(st.integers(min_value=0, max_value=1 << 40), min_size=len(bounds) + 1,
                             max_size=len(bounds) + 1))
    h.sum = draw(st.floats(min_value=0, max_value=1e12))
    return h


@st.composite
def _families(draw):
    kind = draw(st.sampled_from(["gauge", "counter", "histogram"]))
    # Label names on either side of `le` in sorted order, and none at all.
    labels = tuple(draw(st.lists(st.sampled_from(["service", "event", "host", "a", "zz", "priority"]), unique=True,
                                 max_size=3)))
    doc = draw(st.text(max_size=30))
    if kind == "histogram":
        bounds = draw(st.sampled_from([LATENCY_BUCKETS, BATCH_BUCKETS, (0.5,)]))
        values = _histograms(bounds)
    else:
        values = _numbers
    rows = draw(st.lists(st.tuples(st.tuples(*[_label_values] * len(labels)), values), max_size=4,
                         unique_by=lambda r: r[0]))
    return Family(draw(st.sampled_from(["zmq_infer_x", "a_b"])), kind, doc, labels, rows)


@settings(max_examples=300, deadline=None)
@given(st.lists(_families(), max_size=4, unique_by=lambda f: (f.name, f.kind)))
def test_the_writer_matches_prometheus_clients_byte_for_byte(families):
    assert exposition(families) == reference(families)


def test_a_real_scrape_matches_prometheus_clients_writer():
    m = Metrics()
    for name in ("echo", 'we"ird\\name\n', "ünï"):
        m.register(name, 0.0)
        for code in (0, 0, int(P.ErrorCode.QUEUE_FULL), CLIENT_GONE):
            m.final(name, code, 1.0, 1.0004, 1.3)
    fams = render(m.snapshot(), _sched({"echo": (2, 1), "x": (1, 0)}), m.known)
    assert exposition(fams) == reference(fams)
    assert _samples(exposition(fams))  # and it parses
