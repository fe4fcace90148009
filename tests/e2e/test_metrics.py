"""Metrics and health against the real processes: `python -m broker --http 127.0.0.1:0` and
`python -m gpu_worker` (echo, and tests/e2e/gate_model.py's gate, whose calls wait for a byte
the test writes).  After real traffic the test scrapes /metrics, parses it with
prometheus-client's own parser and checks that the counts are what was sent, per outcome (direct
replies, relayed replies, refusals, expiries: one whose deadline passes in the broker's queue
while its client waits on), that the worker-side histograms count every request, that queue
depth rises under a backlog and
returns to 0, and that the batch-size histogram matches the batches the worker ran (each
reply's timing says its batch's size).  The health paths flip as workers come and go.  Every
wait polls a condition with a timeout.
"""
from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from broker import protocol as P

from client_sdk import Client, DeadlineExceeded, QueueFull, ServiceUnavailable
from tests.children import readline_within

from .conftest import wait_service

pytestmark = pytest.mark.timeout(90)

WAIT = 10.0


def get(base: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(base + path, timeout=WAIT) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(base: str) -> dict:
    """{(name, frozenset(labels)): value} of every sample."""
    status, body = get(base, "/metrics")
    assert status == 200, body
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def until(cond, what: str, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.02)  # polling an HTTP endpoint (a condition, not a delay)


def test_counts_queue_depth_batches_and_health(cluster, gate):
    broker = cluster.broker("--http", "127.0.0.1:0", "--max-queue", "3", "--service-grace", "0.3")
    base = "http://" + broker.field("http")
    # Nothing registered yet: alive, not ready, nothing known.
    assert get(base, "/v2/health/live")[0] == 200
    assert get(base, "/v2/health/ready")[0] == 503
    assert get(base, "/v2/models/echo/ready")[0] == 404
    assert get(base, "/v2/models/echo")[0] == 404
    echo = cluster.worker("echo", "--health-port", "127.0.0.1:0")
    gw = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "8", "--no-warmup",
                        env=gate.env, wait=False)
    dw = cluster.worker("gate_model:declared", "--service", "declared", wait=False)
    gate.open()
    gw.wait_ready()
    dw.wait_ready()
    whealth = "http://" + echo.field("health")
    assert get(whealth, "/v2/health/live")[0] == 200
    assert get(whealth, "/v2/health/ready")[0] == 200
    assert get(base, "/v2/health/ready")[0] == 200
    assert get(base, "/v2/models/echo/ready")[0] == 200
    status, body = get(base, "/v2/models/echo")
    info = json.loads(body)
    assert status == 200 and info["name"] == "echo" and info["ready"] is True
    assert len(info["workers"]) == 1 and info["workers"][0]["pid"] == echo.p.pid
    assert "shm" in info["transports"] and info["credit"] >= 1 and info["queue"]["normal"] == 0
    assert info["inputs"] == [] and info["outputs"] == []  # echo declares nothing
    # A model that declares its signature: both halves, as its READY carried them.
    status, body = get(base, "/v2/models/declared")
    declared = json.loads(body)
    assert status == 200 and declared["ready"] is True
    assert declared["inputs"] == [{"name": "image", "datatype": "|u1", "shape": [None, None, 3]}]
    assert declared["outputs"] == [{"name": "image", "datatype": "|u1", "shape": [None, None, 3]}]

    x = {"x": np.arange(16, dtype=np.float32)}
    sent = {"ok": 0}
    with Client(cluster.frontend, timeout=WAIT) as c, \
            Client(cluster.frontend, timeout=WAIT, direct_reply=False) as relayed:
        wait_service(c, "echo")
        for _ in range(20):           # direct replies: counted from the worker's DONEs
            c.infer("echo", x).release()
        for _ in range(7):            # relayed through the broker
            relayed.infer("echo", x).release()
        # A latest-wins stream sent faster than it is answered: its client drops frames
        # and says how many on the next one it sends; the broker counts them.
        with c.stream("echo", latest_wins=True, max_in_flight=1) as st:
            for _ in range(40):
                st.send(x)
            for r in st:
                r.release()
            stream = st.stats()
        assert stream.dropped > 0 and stream.failed == 0
        n_echo = 27 + stream.completed
        sent["ok"] += n_echo
        with pytest.raises(ServiceUnavailable):  # a service nobody serves: counted as _other
            c.infer("nobody", x, timeout=WAIT)
        # A header the broker itself refuses (400, before any queue): counted once too.
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.linger = 0
        raw.connect(cluster.frontend)
        try:
            raw.send_multipart(P.client_request("echo", [P.MAGIC + b"\xc1\xc1 not msgpack"]))
            assert raw.poll(int(WAIT * 1000))
            reply = P.parse_broker_to_client(raw.recv_multipart())
            assert P.decode_reply(reply.body[0]).error.code == 400
        finally:
            raw.close(linger=0)

        # A backlog: one gated call runs alone (the worker holds it), 15 more fill the
        # worker's credit (16 = 2 x max-batch), then the broker's queue (max 3) takes 2, one
        # whose deadline passes there (the SDK's, racing its own timeout), another whose
        # deadline passes there while its client waits longer, one more, and refuses the next.
        wait_service(c, "gate")
        held = [c.infer_stream("gate", x) for _ in range(16)]
        assert c.mmi_service("gate")
        queued = [c.infer_stream("gate", x) for _ in range(2)]
        with pytest.raises(DeadlineExceeded):
            c.infer("gate", x, timeout=0.2)

        def expiries():
            s = scrape(base)
            return (value(s, "zmq_infer_requests_total", service="gate", outcome="deadline_exceeded"),
                    value(s, "zmq_infer_requests_total", service="gate", outcome="cancelled"))

        # The client's deadline and the broker's race: either way, one count.
        expired0, _ = until(lambda: (lambda e: e if sum(e) == 1 else None)(expiries()), "the SDK's expiry counted")
        # A raw client gives its request 200 ms and waits up to WAIT (it never cancels): only the broker's
        # deadline can end it, while it sits queued behind the gated calls.
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.linger = 0
        raw.connect(cluster.frontend)
        try:
            t = P.TensorRef(name="x", dtype=x["x"].dtype.str, shape=list(x["x"].shape), loc=P.InlineLoc(frame=0))
            raw.send_multipart(P.client_request("gate", [P.encode_header(P.Request(id=1, timeout_ms=200, tensors=[t])),
                                                         x["x"].tobytes()]))
            assert raw.poll(int(WAIT * 1000)), "no answer to the expiring request"
            m = P.parse_broker_to_client(raw.recv_multipart())
            assert m.command == P.C_FINAL, m
            err = P.decode_reply(m.body[0]).error
            assert err.code == P.ErrorCode.DEADLINE_EXCEEDED and "waiting for a free 'gate' worker" in err.message, err
        finally:
            raw.close(linger=0)
        assert expiries() == (expired0 + 1, 1 - expired0)
        queued.append(c.infer_stream("gate", x))
        assert c.mmi_service("gate")
        with pytest.raises(QueueFull):
            c.infer("gate", x)
        samples = scrape(base)
        assert value(samples, "zmq_infer_queue_depth", service="gate", priority="normal") == 3
        assert value(samples, "zmq_infer_in_flight", service="gate") == 16
        # Its only worker is saturated (all its credit held, a backlog queued): still ready,
        # or pods would flap out of their Service under load.
        assert get(base, "/v2/models/gate/ready")[0] == 200
        assert json.loads(get(base, "/v2/models/gate")[1])["in_flight"] == 16
        gate.release(40)  # a byte per batch: more than enough
        replies = [h.result(timeout=WAIT) for h in held + queued]
        batches = [r.timing["batch"] for r in replies]
        for r in replies:
            r.release()
        sent["ok"] += len(replies)

    # The worker ran n requests reporting batch size k in n / k batches.
    per_size: dict[float, int] = {}
    for b in batches:
        per_size[b] = per_size.get(b, 0) + 1
    n_batches = {k: n / k for k, n in per_size.items()}
    assert all(v == int(v) for v in n_batches.values()), n_batches

    def settled():
        s = scrape(base)
        ok = value(s, "zmq_infer_requests_total", service="echo", outcome="ok") + \
            value(s, "zmq_infer_requests_total", service="gate", outcome="ok")
        done = ok == sent["ok"] and value(s, "zmq_infer_queue_depth", service="gate", priority="normal") == 0
        # The workers' STATS come once a heartbeat interval.
        done = done and value(s, "zmq_infer_batch_size_count", service="gate") == sum(n_batches.values()) \
            and value(s, "zmq_infer_compute_seconds_count", service="echo") == n_echo \
            and value(s, "zmq_infer_input_seconds_count", service="echo") == n_echo \
            and value(s, "zmq_infer_output_seconds_count", service="echo") == n_echo
        return s if done else None

    s = until(settled, "every answer and every batch counted")
    assert value(s, "zmq_infer_requests_total", service="echo", outcome="ok") == n_echo
    assert value(s, "zmq_infer_stream_dropped_frames_total", service="echo") == stream.dropped
    assert value(s, "zmq_infer_requests_total", service="gate", outcome="ok") == len(batches)
    assert value(s, "zmq_infer_requests_total", service="_other", outcome="service_unavailable") == 1
    assert value(s, "zmq_infer_requests_total", service="gate", outcome="queue_full") == 1
    assert value(s, "zmq_infer_requests_total", service="echo", outcome="protocol_error") == 1
    # The SDK's expiry (the broker's or the client's CANCEL: one count either way) and the
    # raw client's, which only the broker's deadline ended: exactly one more.
    assert value(s, "zmq_infer_requests_total", service="gate", outcome="deadline_exceeded") == expired0 + 1
    assert value(s, "zmq_infer_requests_total", service="gate", outcome="cancelled") == 1 - expired0
    assert value(s, "zmq_infer_request_seconds_count", service="echo") == n_echo
    assert value(s, "zmq_infer_queue_wait_seconds_count", service="echo") == n_echo
    # The gate's: each that ran, and each whose deadline took it out of the queue (the raw
    # client's, and the SDK's when the broker's deadline won): they waited there too.
    assert value(s, "zmq_infer_queue_wait_seconds_count", service="gate") == len(batches) + 1 + expired0
    # The latency histogram holds the results alone: the gate's two expiries and its
    # cancellation or third expiry were in it (as fast answers, for a refusal or a model
    # that fails at once), beside its len(batches) results (the counts hunt).
    assert value(s, "zmq_infer_request_seconds_count", service="gate") == len(batches)
    # Worker-side, once per answered request (direct or relayed): inputs mapped, outputs written.
    assert value(s, "zmq_infer_input_seconds_count", service="echo") == n_echo
    assert value(s, "zmq_infer_output_seconds_count", service="echo") == n_echo
    assert value(s, "zmq_infer_compute_seconds_count", service="echo") == n_echo
    assert value(s, "zmq_infer_workers", service="echo", host=info["hosts"][0]) == 1
    assert value(s, "zmq_infer_in_flight", service="gate") == 0
    # The batch-size histogram holds exactly the batches the gate worker ran.
    bounds = [1, 2, 4, 8, 16]
    for le in bounds:
        want = sum(n for k, n in n_batches.items() if k <= le)
        assert value(s, "zmq_infer_batch_size_bucket", service="gate", le=f"{float(le)}") == want, le
    assert value(s, "zmq_infer_batch_size_sum", service="gate") == sum(k * n for k, n in n_batches.items())
    assert value(s, "zmq_infer_batch_size_bucket", service="echo", le="1.0") == n_echo
    worker_label = f"{echo.p.pid}@{info['hosts'][0]}"
    assert value(s, "zmq_infer_shm_pool_capacity_bytes", service="echo", worker=worker_label) > 0
    # The 20 from the first client went straight back to it (direct reply), the 7 through
    # the broker: both counted.
    assert value(s, "zmq_infer_broker_events_total", event="direct") >= 20

    # The echo worker goes: its service is known but has no worker (503), then back.
    echo.terminate()
    until(lambda: get(base, "/v2/models/echo/ready")[0] == 503, "echo unready")
    assert get(base, "/v2/health/ready")[0] == 200  # gate still serves
    assert get(base, "/v2/models/nope/ready")[0] == 404
    again = cluster.worker("echo")  # READY: the broker's WELCOME came, it is registered
    until(lambda: get(base, "/v2/models/echo/ready")[0] == 200, "echo ready again")
    assert [w["pid"] for w in json.loads(get(base, "/v2/models/echo")[1])["workers"]] == [again.p.pid]


def test_a_registered_service_without_traffic_has_its_series_at_zero(cluster):
    """A worker registers and nobody calls it: its service is in the exposition all the same,
    every outcome's `zmq_infer_requests_total` at 0 (Grafana's service picker,
    `label_values(zmq_infer_requests_total, service)`, lists it; the first request of an
    outcome is an increase that rate() sees, not a series appearing at 1)."""
    from broker.metrics import OUTCOMES

    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    cluster.worker("echo")
    s = until(lambda: (s := scrape(base)) and ("zmq_infer_requests_total", frozenset(
        {"service": "echo", "outcome": "ok"}.items())) in s and s, "the service's series")
    got = {dict(labels)["outcome"]: v for (name, labels), v in s.items()
           if name == "zmq_infer_requests_total" and dict(labels)["service"] == "echo"}
    assert got == dict.fromkeys(OUTCOMES, 0.0)
    assert {"ok", "internal", "service_unavailable", "deadline_exceeded", "client_gone"} <= set(got)
    assert ("zmq_infer_queue_wait_seconds_count", frozenset({"service": "echo"}.items())) in s
    assert not any(dict(labels).get("service") == "_other" for _name, labels in s)  # nothing counted there


def test_pinned_requests_are_counted_from_the_workers_stats(cluster):
    """Requests on a lease never cross the broker: the worker counts them (outcome, and the
    time from its receipt to the FINAL) in its STATS, so once the next STATS is in, the
    broker's counters have risen by exactly the requests that went on the lease."""
    from client_sdk import InvalidInput

    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    cluster.worker("gate_model:declared", "--service", "declared", "--direct")
    good = {"image": np.full((4, 4, 3), 8, np.uint8)}
    bad = {"image": np.zeros((4, 4), np.uint8)}  # not what the model declared: 422, on the lease

    def counts():
        s = scrape(base)
        return (value(s, "zmq_infer_requests_total", service="declared", outcome="ok"),
                value(s, "zmq_infer_requests_total", service="declared", outcome="invalid_input"),
                value(s, "zmq_infer_request_seconds_count", service="declared"))

    with Client(cluster.frontend, timeout=WAIT, pin=True) as c:
        wait_service(c, "declared")
        sent = 0
        deadline = time.monotonic() + WAIT
        while not c.pinned("declared"):  # the first request asks for the lease
            assert time.monotonic() < deadline, "never pinned"
            with c.infer("declared", good) as r:
                assert int(r["image"][0, 0, 0]) == 4
            sent += 1
            if not c.pinned("declared"):
                c.pump(0.05)  # a LEASED on its way is routed
        # Whichever way they went, the requests so far are counted; then only the lease's.
        until(lambda: counts() == (sent, 0, sent), "the requests before the lease counted")
        before = c.pinned_replies
        n = 25
        for _ in range(n):
            with c.infer("declared", good) as r:
                assert int(r["image"][0, 0, 0]) == 4
        with pytest.raises(InvalidInput):
            c.infer("declared", bad)
        assert c.pinned_replies - before == n + 1, "a request left the lease"
    # The pinned error is an outcome, not a latency (the histogram holds results alone).
    until(lambda: counts()[:2] == (sent + n, 1), f"{n} pinned results and 1 pinned error counted")
    assert counts()[2] == sent + n


def test_a_worker_declaring_another_signature_than_its_service_has_is_a_warning(cluster):
    # Two pools of one service with different models (or a worker of last week's model left
    # running): each request went to either, silently, and the model's metadata showed
    # whichever worker came first.  The broker says so once, naming both.
    pytest.importorskip("torch", reason="the convnet model needs torch")
    broker = cluster.broker()
    cluster.worker("gate_model:declared", "--service", "s")
    cluster.worker("convnet", "--service", "s", "--no-warmup")
    broker.wait_log("unlike a live worker of it")
    assert "outputs logits:<f4[1000]" in broker._err.decode() and "outputs image:|u1[None, None, 3]" in broker._err.decode()


def test_a_drained_worker_sends_its_last_counts_before_its_goodbye(cluster):
    # A worker SIGTERMed within a heartbeat interval of its last STATS never sent the rest:
    # its pinned results went uncounted (30 of 31), and its histograms lost that interval.
    broker = cluster.broker("--http", "127.0.0.1:0", "--heartbeat-interval", "1.0")
    base = "http://" + broker.field("http")
    w = cluster.worker("echo", "--direct", "--heartbeat-interval", "1.0")
    x = {"x": np.arange(4)}
    with Client(cluster.frontend, timeout=WAIT, pin=True) as c:
        wait_service(c, "echo")
        deadline = time.monotonic() + WAIT
        while not c.pinned("echo"):
            assert time.monotonic() < deadline, "never pinned"
            c.infer("echo", x).release()
            c.pump(0.05)
        until(lambda: value(scrape(base), "zmq_infer_requests_total", service="echo", outcome="ok") > 0,
              "the requests before the lease counted")
        n0 = value(scrape(base), "zmq_infer_requests_total", service="echo", outcome="ok")
        before = c.pinned_replies
        for _ in range(30):
            c.infer("echo", x).release()
        assert c.pinned_replies - before == 30
        w.p.send_signal(signal.SIGTERM)  # at once: within the interval
        assert w.p.wait(WAIT) == 0
    until(lambda: value(scrape(base), "zmq_infer_requests_total", service="echo", outcome="ok") == n0 + 30,
          "the drained worker's last pinned results counted")


def _pin(c: Client, service: str, inputs: dict) -> int:
    """Call until ``c`` holds a lease on ``service``; the number of calls made."""
    deadline = time.monotonic() + WAIT
    n = 0
    while not c.pinned(service):  # the first request asks for the lease
        assert time.monotonic() < deadline, "never pinned"
        c.infer(service, inputs).release()
        n += 1
        if not c.pinned(service):
            c.pump(0.05)  # a LEASED on its way is routed
    return n


def test_a_pinned_request_past_its_deadline_counts_as_the_deadlines(cluster, tmp_path, gate):
    """A pinned request whose caller's deadline passes while it runs: the client's CANCEL
    says so, and the worker counts it `deadline_exceeded` (it was `cancelled`, out of the
    error-rate alert), as the broker counts a brokered one (found by the observability
    hunt); not in the latency histogram, which holds results alone (the counts hunt)."""
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    cluster.worker("gate_model:held", "--direct", env={"SLEEPY_LOG": str(tmp_path / "runs.log"), **gate.env})
    gate.open()
    quick, held = {"x": np.zeros(1)}, {"x": np.array([-1.0])}

    def counts():
        s = scrape(base)
        return {k: value(s, "zmq_infer_requests_total", service="held", outcome=k)
                for k in ("ok", "deadline_exceeded", "cancelled")}, \
            (value(s, "zmq_infer_request_seconds_sum", service="held"),
             value(s, "zmq_infer_request_seconds_count", service="held"))

    with Client(cluster.frontend, timeout=WAIT, pin=True) as c:
        wait_service(c, "held")
        n = _pin(c, "held", quick)
        deadline = time.monotonic() + WAIT
        while True:  # until one is answered on the lease (its connection is up)
            before = c.pinned_replies
            c.infer("held", quick).release()
            n += 1
            if c.pinned_replies > before:
                break
            assert time.monotonic() < deadline, "no reply on the lease"
        until(lambda: counts()[0]["ok"] == n, "the requests so far counted")
        outcomes0, seconds0 = counts()
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.infer("held", held, timeout=0.3)
        # The batch goes on a while past the deadline (a span measured, not a synchronisation).
        until(lambda: time.monotonic() - t0 >= 1.0, "a second passing")
        gate.release(1)
        c.infer("held", quick).release()  # the lease serves on
    until(lambda: counts()[0]["deadline_exceeded"] == outcomes0["deadline_exceeded"] + 1, "the expiry counted")
    outcomes, (seconds, n_seconds) = counts()
    assert outcomes["cancelled"] == outcomes0["cancelled"], outcomes
    assert outcomes["ok"] == outcomes0["ok"] + 1, outcomes
    # The latency histogram holds results alone: the quick one, not the expired one (the
    # counts hunt; it was in it, with the time its caller waited, as a brokered one was), and
    # never the second and more its batch ran.
    assert n_seconds == seconds0[1] + 1, (n_seconds, seconds0)
    assert seconds - seconds0[0] < 0.5, seconds - seconds0[0]


def test_a_direct_reply_is_settled_while_the_next_batch_runs(cluster, tmp_path, gate):
    """A FINAL that went straight to its client is told to the broker (DONE) within its
    gathering delay, also when the worker starts a long batch on its loop's thread right
    after it: the DONE waited for that batch to end, so the broker counted the request as
    still running, expired it at its deadline (`deadline_exceeded` for a request its client
    had), and, had the worker stopped meanwhile, ran it again elsewhere (the pause hunt)."""
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    # DONEs gathered for up to 200 ms (or 8 // 4 of them): the long request surely starts within that
    cluster.worker("gate_model:held", "--max-batch", "1", "--credit", "8", "--done-delay-ms", "200",
                   env={"SLEEPY_LOG": str(tmp_path / "runs.log"), **gate.env})
    gate.open()

    def count(outcome):
        return value(scrape(base), "zmq_infer_requests_total", service="held", outcome=outcome)

    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "held")
        c.infer("held", {"x": np.zeros(1)}).release()
        until(lambda: count("ok") == 1, "the first request counted")
        direct = c.direct_replies
        with Client(cluster.frontend, timeout=WAIT) as other:
            other.mmi_service("held")  # connected
            # Answered at once, straight to us; the long one, sent right after, starts on the
            # worker's loop thread within the DONE's gathering delay.
            c.infer("held", {"x": np.zeros(1)}, timeout=2.0).release()
            long = other.infer_stream("held", {"x": np.array([-1.0])})
            assert c.direct_replies == direct + 1
            until(lambda: count("ok") == 2, "the direct reply settled while the long batch runs", timeout=1.5)
            assert json.loads(get(base, "/v2/models/held")[1])["in_flight"] == 1
            gate.release(1)
            long.result(timeout=WAIT).release()
    until(lambda: count("ok") == 3, "every request counted")
    assert count("deadline_exceeded") == 0


_PINNED_CHILD = """
import sys, time
import numpy as np
from client_sdk import Client
c = Client(sys.argv[1], timeout=20, pin=True)
deadline = time.monotonic() + 10
n = 0
while True:  # until a request is answered on the lease
    before = c.pinned_replies
    c.infer("held", {"x": np.zeros(1)}).release()
    n += 1
    if c.pinned_replies > before:
        break
    assert time.monotonic() < deadline, "never pinned"
    c.pump(0.05)
# On the lease's local link: each send is in the kernel's socket buffer once infer_stream
# returns (no I/O thread to wait for), so a kill after SENT loses none of the three.
held = [c.infer_stream("held", {"x": np.array([-1.0])}) for _ in range(3)]
assert c.pinned("held")
print("SENT", n, flush=True)
time.sleep(60)
"""


def test_a_dead_pinned_clients_requests_count_as_client_gone_once(cluster, tmp_path, gate):
    """A pinned client SIGKILLed with three requests on its lease (one running, two waiting
    at the worker): the broker ends the lease (client_gone), the running one answers and
    the worker tells the two waiting ones to resend through the broker, and all three
    answers find the client gone.  They count `client_gone`, once each, as a brokered
    request whose client left; before, the two were counted as the service's own 503s
    (phantom errors in the error-rate alert) and the third `ok` (the observability hunt)."""
    import subprocess
    import sys

    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    runs = tmp_path / "runs.log"
    # Credit 8: the lease gets 4 slots, room for the three.
    cluster.worker("gate_model:held", "--direct", "--max-batch", "1", "--credit", "8",
                   env={"SLEEPY_LOG": str(runs), **gate.env})
    gate.open()

    def outcomes():
        s = scrape(base)
        return {k: value(s, "zmq_infer_requests_total", service="held", outcome=k)
                for k in ("ok", "client_gone", "service_unavailable", "cancelled")}

    child = subprocess.Popen([sys.executable, "-c", _PINNED_CHILD, cluster.frontend], stdout=subprocess.PIPE,
                             text=True)
    try:
        sent, n = readline_within(child.stdout, 30, "the pinned child's SENT").split()
        assert sent == "SENT"
        until(lambda: runs.exists() and runs.read_text().count("\n") == 1, "the first held request running")
        child.kill()
        child.wait(WAIT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(WAIT)
        child.stdout.close()
    # The broker ends the lease once the client was silent for its liveness window (the
    # worker, its loop busy with the held request, reads that after it); then the held
    # request ends, and the worker answers it and the two waiting ones.
    until(lambda: value(scrape(base), "zmq_infer_leases", service="held") == 0, "the lease ended")
    # One release for each: the worker may read the LEASE_END only after it started a waiting
    # one (the heartbeat thread stashes what it reads during a batch), and then that one runs
    # and answers a gone client too.  Either way all three count client_gone.
    gate.release(3)
    # (The worker's STATS, its loop held, wait for the release too.)
    want = {"ok": int(n), "client_gone": 3, "service_unavailable": 0, "cancelled": 0}
    until(lambda: outcomes()["client_gone"] == 3, "the three requests counted client_gone")
    assert outcomes() == want


_BROKERED_CHILD = """
import sys, time
import numpy as np
from client_sdk import Client
c = Client(sys.argv[1], timeout=20, direct_reply=False)  # its FINAL through the broker: late for sure
h = c.infer_stream("held", {"x": np.array([-1.0])})
print("SENT", flush=True)  # (the test kills it once the worker ran the request: its run log)
time.sleep(60)
"""


def test_timeouts_count_as_deadlines_and_a_dead_clients_request_as_client_gone(cluster, tmp_path, gate):
    """The metrics hunt: calls that timed out were mostly counted `cancelled` (the client's
    timer beats the broker's by a hair, and its CANCEL said nothing of the deadline: 16 of
    20 queued ones, 7 of 10 running ones), out of any deadline alert; and a brokered request
    running when its client was SIGKILLed was `cancelled` too (the broker's own CANCEL's
    answer), where a pinned one is `client_gone`.  The worker said "cancelled by the
    client" for both."""
    import subprocess
    import sys

    broker = cluster.broker("--http", "127.0.0.1:0", "--log-level", "INFO")
    base = "http://" + broker.field("http")
    runs = tmp_path / "runs.log"
    w = cluster.worker("gate_model:held", "--max-batch", "1", "--credit", "1", "--log-level", "INFO",
                       env={"SLEEPY_LOG": str(runs), **gate.env})
    gate.open()

    def outcomes():
        s = scrape(base)
        return {k: value(s, "zmq_infer_requests_total", service="held", outcome=k)
                for k in ("ok", "deadline_exceeded", "cancelled", "client_gone")}

    held, quick = {"x": np.array([-1.0])}, {"x": np.zeros(1)}
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "held")
        c.infer("held", quick).release()
        # Runs, held past its deadline: one long enough for a loaded machine to start it
        # (the worker logs its run) before it passes.
        running = c.infer_stream("held", held, timeout=1.5)
        until(lambda: runs.exists() and runs.read_text().count("\n") == 1, "the held request running")
        # Wait behind it.  Their deadline is a second later than the running one's, and the
        # test releases it only once all have timed out: its batch ends well past its
        # deadline at the worker too.
        queued = [c.infer_stream("held", quick, timeout=2.5) for _ in range(4)]
        for h in [running, *queued]:
            with pytest.raises(DeadlineExceeded):
                h.result()
        gate.release(1)
        c.infer("held", quick).release()
        # (settled before the client closes: a close racing its last DONE is another story)
        until(lambda: outcomes()["ok"] == 2 and outcomes()["deadline_exceeded"] == 5, "the requests counted")
    assert outcomes() == {"ok": 2, "deadline_exceeded": 5, "cancelled": 0, "client_gone": 0}
    w.wait_log("deadline passed while its batch ran; its result was dropped; its caller gave up")

    def killed_while_its_request_runs(n_runs):
        child = subprocess.Popen([sys.executable, "-c", _BROKERED_CHILD, cluster.frontend],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert readline_within(child.stdout, 30, "the brokered child's SENT").split() == ["SENT"]
            until(lambda: runs.exists() and runs.read_text().count("\n") == n_runs, "the child's request running")
            child.kill()
            child.wait(WAIT)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(WAIT)
            child.stdout.close()
        return child

    child = killed_while_its_request_runs(2)
    left = "a client left while a worker held one of its requests: cancelled there"
    broker.wait_log(left)
    gate.release(1)
    until(lambda: outcomes()["client_gone"] == 1, "the dead client's request counted")
    assert outcomes() == {"ok": 2, "deadline_exceeded": 5, "cancelled": 0, "client_gone": 1}
    # The broker's line names the request as the worker's does (its "request done", or its
    # "cancelled ...: its client left" when it read the CANCEL before the batch ended), so
    # that one grep finds it in both logs (the counts hunt: the broker's had no rid).
    w.wait_log(f"rid={child.pid}:")
    rid = w._err.decode().split(f"rid={child.pid}:")[1].split()[0]
    assert [ln for ln in broker._err.decode().splitlines() if left in ln][0].split("rid=")[1].split()[0] == \
        f"{child.pid}:{rid}"

    # Its result comes before the broker dropped the client (its liveness window): the
    # broker's send finds the connection closed, and the result reached nobody: client_gone
    # too (the counts hunt: `ok`, 4 of 4 such kills, for a client that got nothing).
    killed_while_its_request_runs(3)
    with Client(cluster.frontend, timeout=WAIT) as c:
        c.mmi_service("held")  # a round trip after the kill: the broker's I/O thread saw the close
    gate.release(1)
    until(lambda: sum(outcomes().values()) == 9, "the second dead client's request counted")
    assert outcomes() == {"ok": 2, "deadline_exceeded": 5, "cancelled": 0, "client_gone": 2}
    assert broker._err.decode().count(left) == 1  # not dropped yet when its result came


def test_a_restarted_broker_gets_the_pools_gauges_without_traffic(cluster):
    """The metrics hunt: a worker sends its pools' use only when it changed since its last
    STATS, which went to the broker that died: a restarted broker showed no
    `zmq_infer_shm_pool_capacity_bytes` for the worker until traffic moved the numbers."""
    def capacity(base):
        return [v for (name, labels), v in scrape(base).items()
                if name == "zmq_infer_shm_pool_capacity_bytes" and ("service", "echo") in labels]

    broker = cluster.broker("--http", "127.0.0.1:0")
    w = cluster.worker("echo")
    until(lambda: capacity("http://" + broker.field("http")), "the first broker's gauge")
    broker.kill()  # SIGKILL: the worker registers with the next one
    broker = cluster.broker("--http", "127.0.0.1:0")
    got = until(lambda: capacity("http://" + broker.field("http")), "the restarted broker's gauge")
    assert got == [160 << 20]  # the worker's --out-capacity-mb
    assert w.p.poll() is None


def test_pinned_requests_are_counted_within_moments_not_at_the_next_heartbeat(cluster):
    """The metrics hunt: a worker's STATS carried its leased outcomes once a heartbeat
    interval, so a worker SIGKILLed took the counts of its last interval with it (10 pinned
    requests in no count).  They go out LEASED_STATS_S (50 ms) after the first of them now:
    with 5 s heartbeats, they are in within 2 s, before the worker is killed."""
    broker = cluster.broker("--http", "127.0.0.1:0", "--heartbeat-interval", "5")
    base = "http://" + broker.field("http")
    w = cluster.worker("echo", "--direct", "--heartbeat-interval", "5")
    x = {"x": np.arange(4)}

    def ok():
        return value(scrape(base), "zmq_infer_requests_total", service="echo", outcome="ok")

    with Client(cluster.frontend, timeout=WAIT, pin=True) as c:
        wait_service(c, "echo")
        sent = 0
        deadline = time.monotonic() + WAIT
        while not c.pinned("echo"):
            assert time.monotonic() < deadline, "never pinned"
            c.infer("echo", x).release()
            sent += 1
            if not c.pinned("echo"):
                c.pump(0.05)
        until(lambda: ok() == sent, "the requests before the lease counted", timeout=WAIT)
        before = c.pinned_replies
        for _ in range(10):
            c.infer("echo", x).release()
        assert c.pinned_replies - before == 10
        until(lambda: ok() == sent + 10, "the pinned requests counted", timeout=2.0)
    w.kill()
    assert ok() == sent + 10


def test_a_script_that_leaves_after_its_last_result_drops_nothing_late(cluster):
    # `with Client(): infer` and exit: the worker's FINAL went straight to the client, which
    # read it and said DISCONNECT before the worker's DONE reached the broker.  Those DONEs
    # were counted `dropped_late` (23 of 30), though nothing was dropped or late.
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "echo")
    for _ in range(20):
        with Client(cluster.frontend, timeout=WAIT) as c:
            c.infer("echo", {"x": np.ones(1000, np.float32)}).release()
    def counted():
        m = scrape(base)
        return m if value(m, "zmq_infer_requests_total", service="echo", outcome="ok") == 20 else None

    m = until(counted, "20 requests counted")
    assert value(m, "zmq_infer_broker_events_total", event="dropped_late") == 0
