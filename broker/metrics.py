"""The broker's metrics: what it counts on its loop, and the Prometheus text a scrape reads.

Counting is plain Python on the broker's one thread (a dict look-up and an addition per
event; `broker.protocol.stats.Histogram` for distributions), never a lock on the request
path.  A scrape (`broker.http`, another thread) asks the loop for a `snapshot` (a copy,
taken between two messages) and renders it here: `render` makes plain `Family` tuples,
`exposition` writes them byte for byte as prometheus-client's own writer does (`reference`;
a property test holds the two equal), ten times faster (a render holds the interpreter the
loop needs).  Workers report what only they see
(compute, input and output times, batch sizes, pool use) in STATS messages, merged by
`worker_stats`; a request answered by a worker straight to its client (direct reply) is
counted from the worker's DONE, with the outcome and age the worker sent (`final`), and a
leased (pinned) request, which the broker never sees, from the worker's STATS (its outcome
counts and its receipt-to-FINAL times), so every request is counted once, whichever way its
FINAL went (docs/operations.md, "Metrics").

Label values are bounded: a `service` label is the name of a service some worker registered
(`register`); requests for any other name count under ``_other``, so a client sending random
service names cannot grow the exposition.  A service's series exist from its registration,
before any request: its ``zmq_infer_requests_total`` for every outcome (`OUTCOMES`) at 0, and
its histograms empty; they go when its name is retired (`sweep`) or makes room for another.  Per-worker gauges are dropped when the worker goes
(`prune`, from the broker's housekeeping once a second, and at each scrape), whether or not
anyone scrapes.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Iterable, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from broker.protocol import LEASED_CLIENT_GONE, ErrorCode
from broker.names import MAX_SERVICES as _MAX_SERVICES
from broker.names import RETAIN_S, ServiceNames
from broker.protocol.stats import BATCH_BUCKETS, LATENCY_BUCKETS, Histogram

__all__ = ["Metrics", "Family", "render", "exposition", "reference", "outcome_name", "OTHER", "OUTCOMES", "MAX_SERVICES",
           "CLIENT_GONE", "ServiceNames", "RETAIN_S"]

OTHER = "_other"
#: Distinct service names the metrics keep labels for; more registered names count as OTHER.
MAX_SERVICES = _MAX_SERVICES  # the label bound (broker.names)


_CODES = {int(c): c.name.lower() for c in ErrorCode}
_MAX_COUNT = 1 << 53   # beyond this a count or a byte gauge is not a real one
_MAX_SUM = 1e12        # seconds or requests in one STATS: far beyond any real interval
_MAX_OUTCOMES = 64     # distinct outcome codes in one STATS: far more than ErrorCode has
_GAUGE_FIELDS = ("shm_used", "shm_capacity", "cuda_used", "cuda_capacity", "device_used", "device_total")
_PRIORITIES = ("urgent", "normal", "background")


from broker.state import CLIENT_GONE  # noqa: E402  (the scheduler reports it: never a wire code)


def outcome_name(code: int) -> str:
    """``ok`` for a result, else the error code's name in lower case; ``client_gone`` for
    `CLIENT_GONE`; ``error_other`` for any code this version does not know (one label, so a
    worker sending odd codes cannot grow the exposition)."""
    if not code:
        return "ok"
    if code == CLIENT_GONE:
        return "client_gone"
    return _CODES.get(code) or "error_other"


#: Every outcome label the broker writes: each service's ``zmq_infer_requests_total`` has all
#: of them from the start, at 0 (`_Service`), so that a service nobody has called yet is in
#: the exposition (a dashboard's service picker lists it) and the first request of each
#: outcome is an increase that `rate()` and `increase()` see, not a series that appears at 1.
OUTCOMES = ("ok", *(c.name.lower() for c in ErrorCode), "client_gone", "error_other")


class _Service:
    __slots__ = ("outcomes", "queue_wait", "request", "compute", "input", "output", "batch", "keep_warm",
                 "recalled", "dropped")

    def __init__(self):
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.queue_wait = Histogram(LATENCY_BUCKETS)
        self.request = Histogram(LATENCY_BUCKETS)
        self.compute = Histogram(LATENCY_BUCKETS)
        self.input = Histogram(LATENCY_BUCKETS)
        self.output = Histogram(LATENCY_BUCKETS)
        self.batch = Histogram(BATCH_BUCKETS)
        self.keep_warm = 0
        self.recalled = 0
        self.dropped = 0

    def copy(self) -> "_Service":
        c = object.__new__(_Service)  # taken on the broker's loop, for every service at each scrape
        c.outcomes = self.outcomes.copy()
        c.queue_wait = self.queue_wait.copy()
        c.request = self.request.copy()
        c.compute = self.compute.copy()
        c.input = self.input.copy()
        c.output = self.output.copy()
        c.batch = self.batch.copy()
        c.keep_warm = self.keep_warm
        c.recalled = self.recalled
        c.dropped = self.dropped
        return c


class Metrics:
    """Counted on the broker's loop (not thread-safe: one thread updates, `snapshot` copies)."""

    def __init__(self):
        self.known = ServiceNames()              # service names workers registered (and not retired)
        self.services: dict[str, _Service] = {}
        self.gauges: dict[bytes, tuple[str, int | None, Any]] = {}  # worker -> (service, pid, WorkerStats)
        self.bad_stats = 0

    def label(self, service: str) -> str:
        return service if service in self.known.names else OTHER

    def register(self, service: str, now: float) -> None:
        """A worker registered for ``service``: it gets its own label from now on, and its
        series at once (every outcome's count at 0, empty histograms), traffic or not.  A name
        past the label bound (`MAX_SERVICES`) gets none of its own: it counts under OTHER."""
        gone = self.known.add(service, now)
        if gone is not None:
            self.services.pop(gone, None)
        if service in self.known.names and service not in self.services:
            self.services[service] = _Service()

    def sweep(self, live, now: float) -> None:
        """Once a second: services without a live worker for `RETAIN_S` are forgotten, their
        series with them (a scrape renders the live and the recently retired only)."""
        for name in self.known.sweep(live, now):
            self.services.pop(name, None)

    def _svc(self, service: str) -> _Service:
        name = self.label(service)
        s = self.services.get(name)
        if s is None:
            s = self.services[name] = _Service()
        return s

    def final(self, service: str, code: int, enqueued_at: float | None, dispatched_at: float | None,
              finished_at: float, key: object = None) -> None:
        """One request's FINAL reached (or was sent towards) its client: outcome, the time
        from the broker's receipt to it (a result's only: a fast error, a model that raised
        at once, a refusal, passed for a fast answer in the latency histogram and hid a
        failing service's latency; errors are in the outcome counts), and the time it
        queued before its (last) dispatch, or before its deadline took it out of the queue
        (``dispatched_at``: then when it left; under overload that is where the queue's wait
        is, broker/state.py "Congestion")."""
        s = self._svc(service)
        name = outcome_name(code)
        s.outcomes[name] = s.outcomes.get(name, 0) + 1
        if enqueued_at is not None:
            if not code:
                s.request.observe(max(0.0, finished_at - enqueued_at))
            if dispatched_at is not None:
                s.queue_wait.observe(max(0.0, dispatched_at - enqueued_at))

    def worker_stats(self, worker: bytes, service: str, worker_label: str, st: Any) -> bool:
        """Merge one worker's STATS (deltas of its histograms, its current gauges, shown with
        the label ``worker_label``: its pid and host); False (and nothing merged) when it is
        malformed: counts or sums negative, not finite or absurd."""
        s = self._svc(service)
        pairs = [(s.compute, st.compute), (s.input, st.input), (s.output, st.output), (s.batch, st.batch),
                 (s.request, st.leased_request)]
        leased = st.leased or {}
        try:
            if not isinstance(leased, dict) or len(leased) > _MAX_OUTCOMES:
                raise ValueError("leased outcomes not a small map")
            for code, n in leased.items():
                if type(code) is not int or type(n) is not int or not 0 <= n < _MAX_COUNT:
                    raise ValueError("leased outcome counts negative, huge or non-integer")
            for hist, delta in pairs:
                if delta is None:
                    continue
                counts, total = delta
                if len(counts) != len(hist.counts):
                    raise ValueError("bucket count mismatch")
                if any(type(c) is not int or not 0 <= c < _MAX_COUNT for c in counts):
                    raise ValueError("negative, huge or non-integer counts")
                if not (math.isfinite(total) and 0 <= total < _MAX_SUM):
                    raise ValueError("sum not a finite non-negative number")
            if not 0 <= st.keep_warm_runs < _MAX_COUNT:
                raise ValueError("keep-warm runs out of range")
            if type(st.leased_dropped) is not int or not 0 <= st.leased_dropped < _MAX_COUNT:
                raise ValueError("leased dropped frames out of range")
            for field in _GAUGE_FIELDS:
                v = getattr(st, field)
                if v is not None and not 0 <= v < _MAX_COUNT:
                    raise ValueError(f"{field} out of range")
        except (ValueError, TypeError):
            self.bad_stats += 1
            return False
        for hist, delta in pairs:
            if delta is not None:
                hist.add(delta[0], delta[1])
        s.dropped += st.leased_dropped
        for code, n in leased.items():
            if n:
                # Negatives are odd, but for a leased request whose client was gone.
                name = ("client_gone" if code == LEASED_CLIENT_GONE else
                        outcome_name(code) if code >= 0 else "error_other")
                s.outcomes[name] = s.outcomes.get(name, 0) + n
        s.keep_warm += st.keep_warm_runs
        self.gauges[worker] = (self.label(service), worker_label, st)
        return True

    def recalled(self, service: str, n: int) -> None:
        """``n`` requests asked back from a busy worker of ``service`` for an idle one."""
        self._svc(service).recalled += n

    def dropped(self, service: str, n: int) -> None:
        """A client's latest-wins stream dropped ``n`` frames before sending this request's
        (the request says so: `P.Request.dropped`); bounded per request by sanity."""
        if 0 < n < 1 << 32:
            self._svc(service).dropped += n

    def worker_gone(self, worker: bytes) -> None:
        self.gauges.pop(worker, None)

    def prune(self, alive) -> None:
        """Drop the gauges of workers that are gone (``alive(worker)`` false)."""
        for w in [w for w in self.gauges if not alive(w)]:
            del self.gauges[w]

    def snapshot(self, alive=None) -> dict:
        """A copy for another thread to render; ``alive(worker)``: whether a worker still
        is (the gauges of those that are not are dropped now)."""
        if alive is not None:
            self.prune(alive)
        return {"services": {k: v.copy() for k, v in self.services.items()},
                "gauges": list(self.gauges.values())}


class Family(NamedTuple):
    """One metric family of a scrape, as plain data: ``kind`` is ``gauge``, ``counter`` or
    ``histogram``; ``rows`` are (label values, value) pairs, a value a number, or a
    `Histogram` for a histogram."""
    name: str
    kind: str
    doc: str
    labels: tuple[str, ...]
    rows: list


def _histogram(name: str, doc: str, per_service: Iterable[tuple[str, Histogram]]) -> Family:
    return Family(name, "histogram", doc, ("service",), [((service,), h) for service, h in per_service])


def render(metrics: dict | None, sched: dict, known: Iterable[str]) -> list:
    """The metric families of one scrape: ``metrics`` is a `Metrics.snapshot()` (None when
    the broker counts nothing), ``sched`` the scheduler's `stats()`, ``known`` the service
    names with their own label."""
    known = set(known)
    fams = []
    queue = _gauge("zmq_infer_queue_depth", "Requests queued in the broker, by priority", "service", "priority")
    in_flight = _gauge("zmq_infer_in_flight", "Requests held by the service's workers, through the broker (leased "
                       "ones are not seen: zmq_infer_leased_credit bounds them)", "service")
    workers = _gauge("zmq_infer_workers", "Live workers, by host", "service", "host")
    credit = _gauge("zmq_infer_credit", "Requests the service's live workers may hold at once", "service")
    leases = _gauge("zmq_infer_leases", "Leases (pinned clients) held on the service's workers", "service")
    leased = _gauge("zmq_infer_leased_credit", "Of the credit, what leases hold (not for brokered requests)", "service")
    # Names without their own label add up under OTHER: one series per label set.
    q: dict = {}
    fl: dict = {}
    cr: dict = {}
    ls: dict = {}
    lc: dict = {}
    wk: dict = {}
    for name, s in sched["services"].items():
        label = name if name in known else OTHER
        for pri in _PRIORITIES:
            q[label, pri] = q.get((label, pri), 0) + s["queued"][pri]
        fl[label] = fl.get(label, 0) + s["in_flight"]
        cr[label] = cr.get(label, 0) + s["credit"]
        ls[label] = ls.get(label, 0) + s.get("leases", 0)
        lc[label] = lc.get(label, 0) + s.get("leased_credit", 0)
        for host, n in s.get("hosts", {}).items():
            wk[label, host] = wk.get((label, host), 0) + n
    # A known service the scheduler forgot (its last worker gone, nothing waiting) keeps its
    # series, at 0, until its label is retired (names.py, 10 minutes): they vanished with its
    # last worker, and `zmq_infer_workers == 0` never matched (the operations-docs audit).
    hosted = {k[0] for k in wk}
    for name in known:
        if name not in fl:
            for pri in _PRIORITIES:
                q[name, pri] = 0
            fl[name] = cr[name] = ls[name] = lc[name] = 0
        if name not in hosted:
            wk[name, ""] = 0  # (an empty host: no host label)
    for key in sorted(q):
        queue.rows.append((key, q[key]))
    for key in sorted(fl):
        in_flight.rows.append(((key,), fl[key]))
        credit.rows.append(((key,), cr[key]))
        leases.rows.append(((key,), ls[key]))
        leased.rows.append(((key,), lc[key]))
    for key in sorted(wk):
        workers.rows.append((key, wk[key]))
    fams += [queue, in_flight, workers, credit, leases, leased]
    events = _counter("zmq_infer_broker_events", "Scheduler events since the broker started", "event")
    for event, n in sorted(sched["counters"].items()):
        events.rows.append(((event,), n))
    fams.append(events)
    if metrics is None:
        return fams
    svcs = sorted(metrics["services"].items())
    requests = _counter("zmq_infer_requests", "Requests answered, by outcome (ok or the error's name)",
                        "service", "outcome")
    for name, s in svcs:
        for outcome, n in sorted(s.outcomes.items()):
            requests.rows.append(((name, outcome), n))
    fams.append(requests)
    fams.append(_histogram("zmq_infer_queue_wait_seconds", "Time from the broker's receipt to the dispatch "
                           "that ran the request", ((n, s.queue_wait) for n, s in svcs)))
    fams.append(_histogram("zmq_infer_request_seconds", "Time from the broker's receipt to the FINAL, of "
                           "the requests answered with a result (outcome ok)",
                           ((n, s.request) for n, s in svcs)))
    fams.append(_histogram("zmq_infer_compute_seconds", "Model time of each request's batch (worker-side)",
                           ((n, s.compute) for n, s in svcs)))
    fams.append(_histogram("zmq_infer_input_seconds", "Time mapping a request's inputs (worker-side)",
                           ((n, s.input) for n, s in svcs)))
    fams.append(_histogram("zmq_infer_output_seconds", "Time writing a request's outputs (worker-side)",
                           ((n, s.output) for n, s in svcs)))
    fams.append(_histogram("zmq_infer_batch_size", "Requests per batch run (worker-side)",
                           ((n, s.batch) for n, s in svcs)))
    warm = _counter("zmq_infer_keep_warm_runs", "Keep-warm units the service's workers ran", "service")
    for name, s in svcs:
        warm.rows.append(((name,), s.keep_warm))
    fams.append(warm)
    recalled = _counter("zmq_infer_recalled", "Requests asked back from a busy worker for an idle one, an urgent request "
                        "or another client's turn (RECALL)",
                        "service")
    for name, s in svcs:
        recalled.rows.append(((name,), s.recalled))
    fams.append(recalled)
    dropped = _counter("zmq_infer_stream_dropped_frames", "Frames streams gave up at their clients without "
                       "sending them (a newer frame replaced them, or their deadline came while they waited "
                       "for room), as the clients report", "service")
    for name, s in svcs:
        dropped.rows.append(((name,), s.dropped))
    fams.append(dropped)
    gauges = {
        "shm_used": ("zmq_infer_shm_pool_used_bytes", "Output pool bytes in use, per worker"),
        "shm_capacity": ("zmq_infer_shm_pool_capacity_bytes", "Output pool capacity, per worker"),
        "cuda_used": ("zmq_infer_cuda_pool_used_bytes", "Device output pool bytes in use, per worker"),
        "cuda_capacity": ("zmq_infer_cuda_pool_capacity_bytes", "Device output pool capacity, per worker"),
        "device_used": ("zmq_infer_gpu_memory_used_bytes", "Device memory in use, per worker"),
        "device_total": ("zmq_infer_gpu_memory_total_bytes", "Device memory, per worker"),
    }
    for field, (name, doc) in gauges.items():
        fam = _gauge(name, doc, "service", "worker")
        for service, worker, st in metrics["gauges"]:
            v = getattr(st, field)
            if v is not None:
                fam.rows.append(((service, worker), v))
        fams.append(fam)
    return fams


def _gauge(name: str, doc: str, *labels: str) -> Family:
    return Family(name, "gauge", doc, labels, [])


def _counter(name: str, doc: str, *labels: str) -> Family:
    return Family(name, "counter", doc, labels, [])


def _number(v) -> str:
    """A sample's value as prometheus-client writes it (`floatToGoString`); counts, the most
    common values, without its float round trip."""
    if type(v) is int and 0 <= v < 1_000_000:
        return f"{v}.0"
    return floatToGoString(v)


def _quote(v: str) -> str:
    # Label values as the text format escapes them.
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@functools.lru_cache(maxsize=16)
def _les(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """A histogram's `le` values, +Inf last (`Histogram.cumulative`'s)."""
    return (*(repr(float(b)) for b in bounds), "+Inf")


def exposition(families: list[Family]) -> bytes:
    """The Prometheus text format of ``families``, byte for byte what prometheus-client's
    writer (`generate_latest`) makes of the same families (`reference`; a test holds the two
    equal), several times faster: a scrape's render holds the interpreter that the broker's
    loop needs, about 6 us a line through the library's generic writer and ~120 lines a
    service (`python -m bench.metrics_cost --render`)."""
    out: list[str] = []
    put = out.append
    for f in families:
        name = f.name + "_total" if f.kind == "counter" else f.name
        doc = f.doc.replace("\\", "\\\\").replace("\n", "\\n")
        put(f"# HELP {name} {doc}\n# TYPE {name} {f.kind}\n")
        order = sorted(range(len(f.labels)), key=f.labels.__getitem__)
        if f.kind != "histogram":
            for values, v in f.rows:
                labels = ",".join(f'{f.labels[i]}="{_quote(values[i])}"' for i in order)
                put(f"{name}{{{labels}}} {_number(v)}\n" if labels else f"{name} {_number(v)}\n")
            continue
        # `le` takes its place among the label names in sorted order, as the writer sorts them.
        cut = sum(1 for i in order if f.labels[i] < "le")
        for values, h in f.rows:
            pairs = [f'{f.labels[i]}="{_quote(values[i])}"' for i in order]
            before = "".join(p + "," for p in pairs[:cut])
            after = "".join("," + p for p in pairs[cut:])
            run = 0
            for le, c in zip(_les(h.bounds), h.counts):
                run += c
                put(f'{name}_bucket{{{before}le="{le}"{after}}} {_number(run)}\n')
            labels = "{" + ",".join(pairs) + "}" if pairs else ""
            put(f"{name}_count{labels} {_number(run)}\n{name}_sum{labels} {floatToGoString(h.sum)}\n")
    return "".join(out).encode()


def reference(families: list[Family]) -> bytes:
    """``families`` through prometheus-client's own families and writer: the format
    `exposition` must match (tests)."""
    from prometheus_client.exposition import generate_latest

    fams = []
    for f in families:
        if f.kind == "histogram":
            fam = HistogramMetricFamily(f.name, f.doc, labels=list(f.labels))
            for values, h in f.rows:
                fam.add_metric(list(values), h.cumulative(), sum_value=h.sum)
        else:
            fam = (GaugeMetricFamily if f.kind == "gauge" else CounterMetricFamily)(f.name, f.doc, labels=list(f.labels))
            for values, v in f.rows:
                fam.add_metric(list(values), v)
        fams.append(fam)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(fams))
    return generate_latest(registry)


class _Snapshot(Collector):
    def __init__(self, families: list):
        self._families = families

    def collect(self):
        return iter(self._families)
