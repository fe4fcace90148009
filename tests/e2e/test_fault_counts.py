"""Counts under faults (the counts hunt): each request counted once, with the outcome its
client saw, when a broker restarts under pinned traffic, a CANCEL races a result, or a
client's connection is replaced.  Real processes; every wait polls a condition."""
from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import pytest

from client_sdk import Client

from .conftest import wait_service
from .test_metrics import WAIT, _pin, scrape, until, value

pytestmark = pytest.mark.timeout(60)


def _outcomes(base: str, service: str) -> dict:
    """The outcomes counted for ``service`` (a registered service has every outcome's series
    from the start, at 0: those are left out)."""
    return {dict(labels)["outcome"]: v for (name, labels), v in scrape(base).items()
            if name == "zmq_infer_requests_total" and dict(labels)["service"] == service and v}


def test_pinned_requests_run_while_the_broker_was_down_count_at_its_successor(cluster):
    """The broker is SIGKILLed while a client is pinned: the client's next calls still run on
    the lease (its worker is alive, its connection up) before anyone notices.  The worker
    counted them for its next STATS, which went into the dead broker's connection (or came
    to the new broker before the worker registered there, which drops a stranger's STATS):
    the restarted broker never counted them.  The worker now keeps what it counted until a
    broker that counts has registered it, and sends it then."""
    broker = cluster.broker("--http", "127.0.0.1:0")
    w = cluster.worker("echo", "--direct")
    x = {"x": np.arange(4)}
    with Client(cluster.frontend, timeout=WAIT, pin=True) as c:
        wait_service(c, "echo")
        _pin(c, "echo", x)
        broker.kill()  # SIGKILL: no goodbye, nothing flushed
        before = c.pinned_replies
        for _ in range(10):
            c.infer("echo", x).release()
        assert c.pinned_replies - before == 10, "the calls did not stay on the lease"
        broker = cluster.broker("--http", "127.0.0.1:0")
        base = "http://" + broker.field("http")
        until(lambda: value(scrape(base), "zmq_infer_credit", service="echo"), "the worker registered again")
        until(lambda: _outcomes(base, "echo").get("ok", 0) >= 10, "the pinned calls counted at the new broker",
              timeout=3.0)
    assert w.p.poll() is None
    assert _outcomes(base, "echo") == {"ok": 10}


def test_a_result_that_crosses_its_cancel_counts_as_the_cancellation_its_client_saw(cluster, tmp_path, gate):
    """The worker sent a result straight to its client (direct reply) just before the client
    cancelled the call: the client's call ends `Cancelled` and the result is thrown away
    (its slots released), but the worker's DONE, which comes after the CANCEL, said `ok`,
    and the broker counted `ok`, an answer nobody saw.  A result that reaches the broker
    for a request its client cancelled counts `cancelled` now (relayed or direct); one that
    came before the CANCEL is the client's, and `ok`."""
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    # DONEs gathered for up to 5 s, or 2 of them (credit 8 // 4): the test decides when it goes.
    w = cluster.worker("gate_model:held", "--max-batch", "1", "--credit", "8", "--done-delay-ms", "5000",
                       "--log-level", "INFO", env={"SLEEPY_LOG": str(tmp_path / "runs.log"), **gate.env})
    gate.open()

    def cancels():
        return value(scrape(base), "zmq_infer_broker_events_total", event="cancelled")

    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "held")
        h = c.infer_stream("held", {"x": np.array([-1.0])})
        until(lambda: (tmp_path / "runs.log").exists(), "the call running at the worker")
        gate.release(1)
        w.wait_log("request done")  # its FINAL went straight to the client; its DONE waits
        assert h.cancel()  # the client has not read it: its call ends Cancelled
        until(cancels, "the broker holding the CANCEL")
        assert _outcomes(base, "held") == {}, "the DONE came before the CANCEL: no race to test"
        c.infer("held", {"x": np.zeros(1)}).release()  # a second FINAL: both DONEs go now
        until(lambda: sum(_outcomes(base, "held").values()) == 2, "both requests counted")
        assert h.cancelled
    assert _outcomes(base, "held") == {"ok": 1, "cancelled": 1}


def test_a_retry_of_a_request_its_dead_worker_had_answered_straight_counts_cancelled(cluster):
    """A worker answered a request straight to its client (direct reply) and was SIGKILLed
    before its DONE (gathered for 30 s here: a DONE waits at most half its call's timeout,
    hence the call's 120 s) told the broker: the broker sends the request
    again to another worker (attempt 1), whose inputs the client freed at its answer.  The
    second worker refused the stale slot as a forged descriptor, 400, and the broker
    counted a protocol error for every such death (a chaos soak's protocol_error rate);
    now the retry is taken as cancelled by its sender, and counted so (as is any copy whose
    inputs its sender freed since: tests/bench/test_soak_faults.py's resend after a broker
    restart whose old copy answered first)."""
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    first = cluster.worker("echo", "--done-delay-ms", "30000", "--credit", "8", "--max-batch", "1")
    x = np.arange(2048, dtype=np.float64)  # 16 KiB, not the client's alloc(): a slot freed at the answer
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "echo")
        with c.infer("echo", {"x": x}, timeout=120) as out:
            np.testing.assert_array_equal(out["x"], x)
        assert c.direct_replies == 1, "the answer was relayed: no direct reply to test"
        assert _outcomes(base, "echo") == {}, "the DONE came already: nothing left for a retry"
        second = cluster.worker("echo", "--log-level", "INFO")
        until(lambda: sum(v for (name, labels), v in scrape(base).items()
                          if name == "zmq_infer_workers" and dict(labels)["service"] == "echo") == 2,
              "both workers registered")
        first.kill()
        second.wait_log("taken as cancelled by its sender")
        until(lambda: sum(_outcomes(base, "echo").values()) == 1, "the retry counted")
        assert _outcomes(base, "echo") == {"cancelled": 1}
        c.infer("echo", {"x": x}).release()  # the survivor serves
        until(lambda: _outcomes(base, "echo") == {"cancelled": 1, "ok": 1}, "the survivor's answer counted")


@contextlib.contextmanager
def _relayed_held(tmp_path, credit: int):
    """A broker on tcp (metrics on) behind a `bench.relay.Relay` the test can cut, and one
    `gate_model:held` worker of ``credit``: yields (metrics base URL, the model's run log,
    the gate FIFO's write end, the relay); everything closed after."""
    from bench.relay import Relay

    from .conftest import Proc

    runs, fifo = tmp_path / "runs.log", tmp_path / "gate.fifo"
    os.mkfifo(fifo)
    b = Proc(["-m", "broker", "--frontend", "tcp://127.0.0.1:0", "--backend", f"ipc://{tmp_path}/be.ipc",
              "--heartbeat-interval", "0.2", "--insecure", "--http", "127.0.0.1:0"])
    w = relay = gate = None
    try:
        b.wait_ready()
        w = Proc(["-m", "gpu_worker", "--broker", f"ipc://{tmp_path}/be.ipc", "--model", "gate_model:held",
                  "--heartbeat-interval", "0.2", "--credit", str(credit)],
                 env={"SLEEPY_LOG": str(runs), "GATE_FIFO": str(fifo)})
        w.wait_ready()
        gate = os.open(fifo, os.O_WRONLY)
        relay = Relay(int(b.field("frontend").rsplit(":", 1)[1]))
        yield "http://" + b.field("http"), runs, gate, relay
    finally:
        if relay is not None:
            relay.close()
        if gate is not None:
            os.close(gate)
        for p in (w, b):
            if p is not None:
                p.close()


def test_a_stream_frame_sent_again_on_a_new_connection_reports_its_drops_once(tmp_path):
    """A latest-wins stream over tcp: a frame that carries the count of frames dropped before
    it is running when the connection to the broker is reset; the client sends it again on
    the new connection, and the copy carried the same count: the broker counted those drops
    twice (its first copy reached it).  A call sent again (a replaced connection, NOT_LOCAL's
    inline resend) now says nothing of its drops: they are counted once, with the first."""
    with _relayed_held(tmp_path, credit=4) as (base, runs, gate, relay):
        held = {"x": np.array([-1.0])}

        def running(n):
            until(lambda: runs.exists() and runs.read_text().count("\n") == n, f"{n} held frame(s) run")

        with Client(f"tcp://127.0.0.1:{relay.port}", insecure=True, timeout=WAIT, heartbeat_interval=0.2) as c:
            assert c.mmi_service("held")  # the hello's answer named the connection
            with c.stream("held", latest_wins=True, max_in_flight=1, pin=False) as st:
                st.send(held)
                running(1)
                for _ in range(4):  # three replaced by the fourth, which waits for the first
                    st.send(held)
                os.write(gate, b"x")
                st.recv(timeout=WAIT).release()  # the fourth goes now, telling of 3 drops
                running(2)
                relay.cut()  # while it runs: sent again on the new connection
                os.write(gate, b"xx")  # its first run (answered into the old connection) and its second
                st.recv(timeout=WAIT).release()
                assert c.broker_reconnects == 1 and c.resent_calls == 1
                dropped = st.stats().dropped
        assert dropped == 3
        until(lambda: sum(_outcomes(base, "held").values()) == 3, "the frames counted")
        assert value(scrape(base), "zmq_infer_stream_dropped_frames_total", service="held") == dropped


def test_calls_sent_again_on_a_replaced_connection_count_once_per_copy(tmp_path):
    """A client's tcp connection is reset with one call running and one queued behind it:
    the old connection's copies reach nobody (`client_gone`, once each: the running one's
    result finds the connection gone, the queued one is dropped with its client or runs for
    nobody), the client's resends are `ok`, once each, and the gauges come back to 0."""
    with _relayed_held(tmp_path, credit=1) as (base, runs, gate, relay):
        with Client(f"tcp://127.0.0.1:{relay.port}", insecure=True, timeout=WAIT, heartbeat_interval=0.2) as c:
            assert c.mmi_service("held")
            hs = [c.infer_stream("held", {"x": np.array([-1.0])}) for _ in range(2)]
            until(lambda: runs.exists() and runs.read_text().count("\n") == 1, "the first call running")
            until(lambda: value(scrape(base), "zmq_infer_queue_depth", service="held", priority="normal") == 1,
                  "the second queued")
            relay.cut()
            os.write(gate, b"x" * 4)  # up to two runs each: the old copies' and the resends'
            for h in hs:
                h.result(timeout=WAIT).release()
            assert c.broker_reconnects == 1 and c.resent_calls == 2

        def settled():
            s = scrape(base)
            return (value(s, "zmq_infer_in_flight", service="held") == 0
                    and value(s, "zmq_infer_queue_depth", service="held", priority="normal") == 0
                    and sum(_outcomes(base, "held").values()) == 4)

        until(settled, "every copy counted, nothing held")
        assert _outcomes(base, "held") == {"ok": 2, "client_gone": 2}


def test_a_cancelled_call_whose_deadline_passes_before_its_worker_confirms_counts_cancelled(cluster, gate):
    """A running call is cancelled by its client (its call ends `Cancelled`); its worker is in
    a batch that runs to its end, so the cancellation is not confirmed before the call's
    deadline, which answered it: `deadline_exceeded` (and the `expired` event), an outcome
    its client never saw.  It counts `cancelled`, once: the worker's late answer is dropped."""
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    cluster.worker("gate_model:factory", "--service", "gate", env=gate.env, wait=False)
    gate.open()

    def event(name):
        return value(scrape(base), "zmq_infer_broker_events_total", event=name)

    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "gate")
        h = c.infer_stream("gate", {"x": np.zeros(1)}, timeout=3.0)  # (room to reach the gate, and cancel)
        gate.wait_entered(1)
        assert h.cancel()
        until(lambda: sum(_outcomes(base, "gate").values()), "the call answered at its deadline")
        gate.release(1)
        until(lambda: event("dropped_late"), "the worker's late answer")
        assert h.cancelled
    assert _outcomes(base, "gate") == {"cancelled": 1}
    assert event("expired") == 0 and event("cancelled") == 1
    assert value(scrape(base), "zmq_infer_in_flight", service="gate") == 0
