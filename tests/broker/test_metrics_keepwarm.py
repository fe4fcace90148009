"""The keep-warm counter at the broker: `zmq_infer_keep_warm_runs_total{service=...}` adds up
the `keep_warm_runs` of its workers' STATS, each the units a worker ran since its previous
STATS (a delta, as gpu_worker.worker sends it), so the counter is the service's total and
never goes down.  In process: broker.metrics fed STATS as the broker loop parses them."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker import protocol as P
from broker.metrics import OTHER, Metrics, exposition, render

pytestmark = pytest.mark.timeout(30)

NAME = "zmq_infer_keep_warm_runs_total"


def _sched() -> dict:
    return {"services": {}, "counters": {}}


def _stats(warm: int) -> P.WorkerStats:
    """A worker's STATS as the broker loop has it: encoded, sent, parsed."""
    return P.parse_worker(P.worker_stats(P.WorkerStats(keep_warm_runs=warm))).info


def _keep_warm(m: Metrics) -> dict[str, float]:
    text = exposition(render(m.snapshot(), _sched(), m.known)).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == NAME:
                assert set(s.labels) == {"service"}, s
                out[s.labels["service"]] = s.value
    return out


def test_keep_warm_runs_of_two_workers_add_up_per_service():
    m = Metrics()
    m.register("echo", 0.0)
    m.register("cartoon", 0.0)
    assert m.worker_stats(b"w1", "echo", "11@h", _stats(3))
    assert m.worker_stats(b"w2", "echo", "12@h", _stats(4))
    assert _keep_warm(m) == {"echo": 7, "cartoon": 0}  # registered: its series at 0 from the start
    # Later STATS carry only what ran since: added, not replacing the worker's last figure.
    assert m.worker_stats(b"w1", "echo", "11@h", _stats(2))
    assert m.worker_stats(b"w2", "echo", "12@h", _stats(0))  # nothing new: no change
    assert m.worker_stats(b"w3", "cartoon", "13@h", _stats(5))
    assert _keep_warm(m) == {"echo": 9, "cartoon": 5}


def test_the_counter_outlives_its_workers_and_never_goes_down():
    m = Metrics()
    m.register("echo", 0.0)
    assert m.worker_stats(b"w1", "echo", "11@h", _stats(6))
    # The worker went away: its gauges go, the service's counter stays.
    assert _keep_warm(m) == {"echo": 6}
    m.snapshot(alive=lambda w: False)
    assert _keep_warm(m) == {"echo": 6}
    assert m.worker_stats(b"w4", "echo", "14@h", _stats(1))  # its replacement adds to it
    assert _keep_warm(m) == {"echo": 7}


def test_malformed_keep_warm_counts_are_not_added():
    m = Metrics()
    m.register("echo", 0.0)
    assert m.worker_stats(b"w1", "echo", "11@h", _stats(2))
    assert not m.worker_stats(b"w1", "echo", "11@h", P.WorkerStats(keep_warm_runs=-1))
    assert not m.worker_stats(b"w1", "echo", "11@h", P.WorkerStats(keep_warm_runs=1 << 60))
    assert m.bad_stats == 2
    assert _keep_warm(m) == {"echo": 2}


def test_a_service_no_worker_registered_counts_under_other():
    m = Metrics()
    m.register("echo", 0.0)
    assert m.worker_stats(b"w1", "stranger", "11@h", _stats(3))
    assert _keep_warm(m) == {"echo": 0, OTHER: 3}
