"""broker.names.ServiceNames: the service names the broker keeps labels and 404/503 answers
for, bounded and retired.  A deployment that starts and retires services (a name per model
version, per tenant) had filled the list with the dead for good: a new service counted under
``_other`` and answered 404 for its readiness, and each scrape rendered every dead name."""
from __future__ import annotations

from broker.metrics import OTHER, Metrics
from broker.names import ServiceNames


def test_a_name_without_a_live_worker_is_forgotten_after_the_retention():
    n = ServiceNames(cap=10, retain=600.0)
    n.add("a")
    n.add("b")
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
    n = ServiceNames(cap=3, retain=600.0)
    for name in ("a", "b", "c"):
        n.add(name)
    live = {"c"}
    n.sweep(lambda x: x in live, 0.0)  # a and b dead since 0
    n.sweep(lambda x: x in live, 5.0)
    n.forget("a")
    n.add("a")  # (back: live again, and dead again later than b)
    n.sweep(lambda x: x in live, 10.0)
    assert n.add("d") == "b"  # dead longest
    assert set(n) == {"a", "c", "d"}
    live |= {"a", "d"}
    n.sweep(lambda x: x in live, 11.0)
    assert n.add("e") is None and "e" not in n  # every one live: the newcomer gets no label


def test_metrics_drop_a_retired_services_series_and_label_a_newcomer():
    m = Metrics()
    m.known = ServiceNames(cap=2, retain=60.0)
    m.register("old")
    m.register("live")
    m.final("old", 0, 0.0, 0.0, 0.1)
    m.sweep(lambda s: s == "live", 0.0)
    m.register("new")  # full: "old" (no worker) makes room
    assert m.label("new") == "new" and m.label("old") == OTHER and "old" not in m.services
    m.final("new", 0, 0.0, 0.0, 0.1)
    assert m.services["new"].outcomes == {"ok": 1}
