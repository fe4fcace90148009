"""broker.names.ServiceNames: the service names the broker keeps labels and 404/503 answers
for, bounded and retired.  A deployment that starts and retires services (a name per model
version, per tenant) had filled the list with the dead for good: a new service counted under
``_other`` and answered 404 for its readiness, and each scrape rendered every dead name."""
from __future__ import annotations

from broker.metrics import OTHER, Metrics
from broker.names import ServiceNames
from broker.state import Scheduler


def test_a_name_without_a_live_worker_is_forgotten_after_the_retention():
    n = ServiceNames(cap=10, retain=600.0)
    n.add("a", 0.0)
    n.add("b", 0.0)
    live = {"a"}
    assert n.sweep(live.__contains__, 0.0) == []
    assert n.sweep(live.__contains__, 599.0) == [] and "b" in n
    live.add("b")  # a worker came back in time: its clock starts again
    assert n.sweep(live.__contains__, 599.5) == []
    live.discard("b")
    n.sweep(live.__contains__, 700.0)
    assert n.sweep(live.__contains__, 1299.0) == [] and n.sweep(live.__contains__, 1300.0) == ["b"]
    assert list(n) == ["a"]


def test_a_newcomer_takes_the_place_of_the_name_dead_longest_when_full():
    n = ServiceNames(cap=3, retain=600.0, evict_after=60.0)
    for name in ("a", "b", "c"):
        n.add(name, 0.0)
    live = {"c"}
    n.sweep(lambda x: x in live, 0.0)  # a and b without a worker since 0
    n.sweep(lambda x: x in live, 5.0)
    n.forget("a")
    n.add("a", 5.0)  # (back: live again, and without a worker again later than b)
    n.sweep(lambda x: x in live, 10.0)
    assert n.add("d", 30.0) is None and "d" not in n  # none without a worker for 60 s yet (a restart's backoff)
    assert n.add("d", 70.0) == "b"  # b: without one longest, and for long enough
    assert set(n) == {"a", "c", "d"}
    live |= {"a", "d"}
    n.sweep(lambda x: x in live, 71.0)
    assert n.add("e", 200.0) is None and "e" not in n  # every one live: the newcomer gets no label


def test_metrics_drop_a_retired_services_series_and_label_a_newcomer():
    m = Metrics()
    m.known = ServiceNames(cap=2, retain=600.0, evict_after=60.0)
    m.register("old", 0.0)
    m.register("live", 0.0)
    m.final("old", 0, 0.0, 0.0, 0.1)
    m.sweep(lambda s: s == "live", 0.0)
    m.register("new", 100.0)  # full: "old" (no worker for 100 s) makes room
    assert m.label("new") == "new" and m.label("old") == OTHER and "old" not in m.services
    m.final("new", 0, 0.0, 0.0, 0.1)
    assert {k: n for k, n in m.services["new"].outcomes.items() if n} == {"ok": 1}  # (the others at 0)


def test_a_name_is_kept_while_requests_wait_for_a_worker():
    # Retired while its requests still waited (a service grace of 10 minutes or more), a
    # service's readiness said 404 and their outcomes went under _other.
    s = Scheduler()
    s.worker_ready(b"w", "svc", 0.0)
    s.worker_disconnect(b"w", 1.0)
    assert not s.holds_service("svc")
    s.client_request(b"c", 1, "svc", 2.0, payload=b"")  # waits for a worker (grace)
    assert s.holds_service("svc") and not s.has_service("svc")
