"""A client on an ipc frontend is presumed dead when its process is gone, not because its
program went quiet: a blocking `Client` heartbeats only from inside its calls, so a program
that sends a request, does something else for longer than the broker's client liveness
window, and then asks for the result must still get it (broker.server `_look_at_quiet`);
nor does the client take the broker's silence over that spell, when it was not listening,
for the broker's (ClientCore.looking)."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from client_sdk import AsyncClient, Client

from .conftest import Proc, wait_service
from .test_metrics import scrape, until, value

pytestmark = pytest.mark.timeout(120)

# The cluster's broker heartbeats every 0.2 s: its client liveness window is 0.6 s.  The
# clients' own window (silence before a waiting call fails with BrokerUnreachable) is 5
# heartbeat intervals: 1.5 s here.  The quiet spell is longer than both.
QUIET_S = 2.0
HB_S = 0.3


def test_a_quiet_blocking_client_keeps_its_requests_in_flight_and_queued(cluster, gate):
    cluster.broker()
    w = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "1",
                       "--no-warmup", env=gate.env, wait=False)
    gate.open()
    w.wait_ready()
    with Client(cluster.frontend, timeout=60, heartbeat_interval=HB_S) as c:
        wait_service(c, "gate")
        xs = [np.full(4, i, np.int32) for i in (1, 2)]
        calls = [c.infer_stream("gate", {"x": x}) for x in xs]  # one at the worker, one queued
        assert c.mmi_service("gate")  # a barrier: the broker has both
        # The program does something else, not calling into the client, for more than three
        # client liveness windows: the scenario itself, not a synchronisation.
        time.sleep(QUIET_S)
        gate.release(2)
        for x, call in zip(xs, calls):
            with call.result() as r:
                np.testing.assert_array_equal(r["x"], x)
            call.close()
        assert c.stray_replies == 0


CLIENT = """
import sys, numpy as np
from client_sdk import Client
c = Client(sys.argv[1], timeout=60)
calls = [c.infer_stream("gate", {"x": np.zeros(4, np.int32)}) for _ in range(3)]
assert c.mmi_service("gate")
print("READY", flush=True)
sys.stdin.read()
"""


def test_a_killed_clients_queued_requests_are_still_dropped(cluster, gate):
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    w = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "1",
                       "--no-warmup", env=gate.env, wait=False)
    gate.open()
    w.wait_ready()
    client = Proc(["-c", CLIENT, cluster.frontend], stdin=True)
    cluster.procs.append(client)
    client.wait_ready()
    until(lambda: value(scrape(base), "zmq_infer_queue_depth", service="gate", priority="normal") == 2,
          "two requests queued")
    client.kill()  # its connection closes: silence from now on is death
    until(lambda: value(scrape(base), "zmq_infer_queue_depth", service="gate", priority="normal") == 0,
          "the dead client's queued requests dropped", timeout=10)
    gate.release(1)  # the one at the worker finishes for nobody


def test_a_quiet_pinned_client_keeps_its_lease_and_its_requests(cluster, gate):
    cluster.broker()
    w = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--direct", "--no-warmup",
                       env=gate.env, wait=False)
    gate.open()
    w.wait_ready()
    with Client(cluster.frontend, timeout=60, pin=True, heartbeat_interval=HB_S) as c:
        wait_service(c, "gate")
        first = c.infer_stream("gate", {"x": np.zeros(4, np.int32)})  # asks for the lease (brokered)
        deadline = time.monotonic() + 30
        while not c.pinned("gate"):
            assert time.monotonic() < deadline, "no lease within 30 s"
            c.pump(0.05)
        gate.release(1)
        with first.result() as r:
            assert r["x"].shape == (4,)
        first.close()
        before = c.pinned_replies
        x = np.arange(4, dtype=np.int32)
        call = c.infer_stream("gate", {"x": x})  # on the lease, held at the worker by the gate
        time.sleep(QUIET_S)  # the program's own work, past three liveness windows: the scenario
        gate.release(1)
        with call.result() as r:
            np.testing.assert_array_equal(r["x"], x)
        call.close()
        assert c.pinned("gate") and c.pinned_replies == before + 1  # the lease held: it came the pinned way
        assert c.stray_replies == 0


def test_an_asyncio_client_whose_loop_was_held_keeps_its_request(cluster, gate):
    """The asyncio twin: an application holds the event loop (a blocking call in a coroutine)
    for longer than both liveness windows while a request waits at the worker."""
    cluster.broker()
    w = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--no-warmup",
                       env=gate.env, wait=False)
    gate.open()
    w.wait_ready()

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=60, heartbeat_interval=HB_S) as c:
            while not await c.mmi_service("gate"):
                await asyncio.sleep(0.01)
            x = np.arange(4, dtype=np.int32)
            task = asyncio.create_task(c.infer("gate", {"x": x}))
            while c.in_flight() < 1:
                await asyncio.sleep(0)
            assert await c.mmi_service("gate")  # a barrier: the request is at the worker
            time.sleep(QUIET_S)  # the loop held by its application: the scenario itself
            gate.release(1)
            r = await asyncio.wait_for(task, 30)
            np.testing.assert_array_equal(r["x"], x)
            r.release()

    asyncio.run(scenario())


def _tcp_broker(cluster) -> str:
    """A broker on a tcp frontend of the kernel's port (its READY names it: a port picked
    here and bound there may be taken meanwhile)."""
    broker = Proc(["-m", "broker", "--frontend", "tcp://127.0.0.1:0", "--backend", cluster.backend,
                   "--heartbeat-interval", "0.2", "--insecure"])
    cluster.procs.append(broker)
    broker.wait_ready()
    return broker.field("frontend")


def test_over_tcp_an_idle_client_forgotten_for_its_silence_keeps_its_name(cluster, gate):
    """Idle past the broker's window (nothing in flight: no heartbeats), the client loses
    nothing when the broker drops its record: its next call is not sent twice."""
    frontend = _tcp_broker(cluster)
    w = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--no-warmup",
                       env=gate.env, wait=False)
    gate.open()
    w.wait_ready()
    with Client(frontend, timeout=60, heartbeat_interval=HB_S, insecure=True) as c:
        wait_service(c, "gate")
        time.sleep(QUIET_S)  # idle, past the broker's window: the scenario itself
        x = np.arange(4, dtype=np.int32)
        call = c.infer_stream("gate", {"x": x})
        assert c.mmi_service("gate")  # a barrier: at the worker, and the heartbeat answered
        gate.release(1)  # one run: a resend would wait at the gate for a second
        with call.result() as r:
            np.testing.assert_array_equal(r["x"], x)
        call.close()
        assert c.broker_reconnects == 0


def test_over_tcp_a_quiet_client_that_was_forgotten_sends_its_requests_again(cluster, gate):
    """Over tcp silence counts: past the broker's window the quiet client's queued request
    is dropped and its running one cancelled.  Heard again, it is a new record for the
    broker, whose heartbeat answer names it anew: the client sends what it still waits for
    again, as after a new connection, and gets its results."""
    frontend = _tcp_broker(cluster)
    w = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "1",
                       "--no-warmup", env=gate.env, wait=False)
    gate.open()
    w.wait_ready()
    with Client(frontend, timeout=60, heartbeat_interval=HB_S, insecure=True) as c:
        wait_service(c, "gate")
        xs = [np.full(4, i, np.int32) for i in (1, 2)]
        calls = [c.infer_stream("gate", {"x": x}) for x in xs]  # one at the worker, one queued
        assert c.mmi_service("gate")
        time.sleep(QUIET_S)  # the program's own work, past the broker's window: the scenario
        gate.release(3)  # the cancelled first run (it cannot stop), then the two sent again
        for x, call in zip(xs, calls):
            with call.result() as r:
                np.testing.assert_array_equal(r["x"], x)
            call.close()
        assert c.broker_reconnects == 1  # the new name: as after a new connection


def test_an_idle_asyncio_client_s_heartbeat_task_waits_for_its_next_request(cluster, monkeypatch):
    """Nothing waiting and no lease held, no heartbeat is due, yet the asyncio client's
    heartbeat task woke every half period (the idle hunt: 50 idle clients, 95 wake-ups and
    13 ms of CPU a second).  It waits for the next request now, and beats again for it."""
    cluster.broker()
    cluster.worker("echo")
    beats = []
    real = AsyncClient._beat

    def counted(self):
        beats.append(time.monotonic())
        real(self)

    monkeypatch.setattr(AsyncClient, "_beat", counted)

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=10, heartbeat_interval=0.02) as c:
            (await c.infer("echo", {"x": np.arange(3)})).release()
            n = len(beats)
            await asyncio.sleep(0.5)  # the idle spell measured (25 half periods)
            idle = len(beats) - n
            assert idle <= 2, f"{idle} heartbeat turns in 0.5 s with nothing to do"
            out = await c.infer("echo", {"x": np.arange(5)})  # the task wakes for it
            np.testing.assert_array_equal(out["x"], np.arange(5))
            out.release()

    asyncio.run(asyncio.wait_for(scenario(), 30))
