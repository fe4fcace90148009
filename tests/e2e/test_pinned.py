"""Pinned streams through the SDK (`pin=True`, docs/client.md "Pinned streams"), with real
broker and `python -m gpu_worker --direct` processes: a pinned client's requests go straight
to the leased worker and its replies come back the same way (`pinned_replies`), a service
whose workers take no leases stays brokered, and every end of a lease (the worker SIGKILLed
with 64 requests in flight on it, or SIGTERMed while it holds some) completes every request
exactly once, through the broker where needed, after which the client pins again.  A plain
MDP client works beside it all along."""
from __future__ import annotations

import asyncio
import select
import time

import numpy as np
import pytest
import zmq

from broker import protocol as P
from client_sdk import AsyncClient, Client, DeadlineExceeded
from tests.e2e.conftest import wait_service

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 10.0


def _echo(c: Client, service: str, i: int) -> None:
    x = np.full(16, i, np.int64)
    with c.infer(service, {"x": x}, timeout=TIMEOUT_S) as r:
        np.testing.assert_array_equal(r["x"], x)


def _until_pinned(c: Client, service: str, timeout: float = TIMEOUT_S) -> None:
    """Echo requests (the first one asks for the lease) until the client holds one; the
    backoff after an end is 1 s, so this waits for a condition, never a fixed time."""
    deadline = time.monotonic() + timeout
    i = 0
    while not c.pinned(service):
        assert time.monotonic() < deadline, f"not pinned to {service!r} within {timeout} s"
        _echo(c, service, i)
        i += 1
        if not c.pinned(service):
            c.pump(0.05)  # a LEASED on its way is routed


def _pump_until(c: Client, cond, what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        c.pump(0.05)


def _start_pumping(c: Client, proc, timeout: float = 30.0) -> None:
    """Wait for `proc`'s READY line while `c` pumps (and so heartbeats)."""
    deadline = time.monotonic() + timeout
    while not select.select([proc.p.stdout.fileno()], [], [], 0)[0]:
        assert time.monotonic() < deadline, f"{proc.args} not ready within {timeout} s"
        c.pump(0.05)
    proc.wait_ready()


def _plain_echo(frontend: str, service: str, value: int) -> None:
    """A plain MDP client: a raw DEALER that never heard of leases."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.connect(frontend)
    try:
        x = np.full(4, value, np.int32)
        head = P.Request(id=7, tensors=[P.TensorRef(name="x", dtype=x.dtype.str, shape=[4], loc=P.InlineLoc(frame=0))])
        s.send_multipart(P.client_request(service, [P.encode_header(head), x.tobytes()]))
        assert s.poll(TIMEOUT_S * 1000), "the plain client got no reply"
        msg = P.parse_broker_to_client(s.recv_multipart())
        assert msg.command == P.C_FINAL
        rep = P.decode_reply(msg.body[0], n_inline=len(msg.body) - 1)
        assert rep.error is None and rep.id == 7, rep.error
        [t] = rep.tensors
        np.testing.assert_array_equal(np.frombuffer(msg.body[1 + t.loc.frame], np.int32), x)
    finally:
        s.close(0)


def test_pinned_clients_get_their_replies_straight_from_the_worker(cluster):
    cluster.broker()
    cluster.worker("echo", "--direct")
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        wait_service(c, "echo")
        _until_pinned(c, "echo")
        before, relayed = c.pinned_replies, c.direct_replies
        for i in range(40):
            _echo(c, "echo", i)
        assert c.pinned_replies - before == 40 and c.direct_replies == relayed  # none crossed the broker
        # A stream on a pinned client is pinned too.
        with c.stream("echo", latest_wins=False, max_in_flight=2) as st:
            for i in range(6):
                st.send({"x": np.full(3, i, np.int16)})
            for i in range(6):
                with st.recv(timeout=TIMEOUT_S) as r:
                    np.testing.assert_array_equal(r["x"], np.full(3, i, np.int16))
        assert c.pinned_replies - before == 46
        _plain_echo(cluster.frontend, "echo", 5)
        assert c.stray_replies == 0

    asyncio.run(asyncio.wait_for(async_pinned_echoes(cluster.frontend), 30))


async def async_pinned_echoes(frontend: str, on_pinned=None) -> None:
    """An `AsyncClient(pin=True)` pins to "echo" (``on_pinned(client)`` then looks at it),
    and 40 requests, 8 at a time (the lease's slots), all come straight from the worker."""
    async with AsyncClient(frontend, timeout=TIMEOUT_S, pin=True) as ac:
        deadline = time.monotonic() + TIMEOUT_S
        while not ac.pinned("echo"):
            assert time.monotonic() < deadline, "the AsyncClient never pinned"
            r = await ac.infer("echo", {"x": np.arange(4)})
            r.release()
            if not ac.pinned("echo"):
                await ac.pump(0.05)
        if on_pinned is not None:
            on_pinned(ac)
        before = ac.pinned_replies
        for k in range(5):
            xs = [np.full(8, 100 * k + i, np.float32) for i in range(8)]
            outs = await asyncio.gather(*(ac.infer("echo", {"x": x}) for x in xs))
            for x, out in zip(xs, outs):
                np.testing.assert_array_equal(out["x"], x)
                out.release()
        assert ac.pinned_replies - before == 40 and ac.stray_replies == 0


def test_a_service_without_direct_workers_stays_brokered(cluster):
    cluster.broker()
    cluster.worker("echo")  # no --direct: never leased
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        wait_service(c, "echo")
        for i in range(5):
            _echo(c, "echo", i)
        c.mmi_service("echo")  # a barrier: the LEASE's refusal came before this answer
        assert not c.pinned("echo") and c.pinned_replies == 0
        for i in range(5):  # within the backoff: no new ask, still brokered
            _echo(c, "echo", i)
        assert c.pinned_replies == 0 and c.stray_replies == 0


@pytest.mark.parametrize("link", [True, False], ids=["link", "ipc"])  # the local link, or the ipc direct socket
def test_sigkill_of_the_pinned_worker_with_64_in_flight_loses_and_duplicates_nothing(cluster, gate, link):
    cluster.broker()
    no_link = () if link else ("--no-link",)
    # Credit 160: a lease holds at most half a worker's credit, so all 64 fit on it.  With
    # fewer slots the rest went through the broker, some to this worker, and one of those
    # at the gate first had the pinned ones behind it answered 429 ("not parked behind
    # another's long batch", docs/client.md) and sent through the broker to the echo.
    doomed = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "160",
                            "--no-warmup", "--direct", *no_link, env=gate.env, wait=False)
    gate.open()
    doomed.wait_ready()
    with Client(cluster.frontend, timeout=30, pin=64) as c:
        # The first request asks for the lease, and waits at the gate (brokered) meanwhile.
        first = c.infer_stream("gate", {"x": np.arange(3)})
        _pump_until(c, lambda: c.pinned("gate"), "the lease")
        gate.release(1)
        with first.result(timeout=TIMEOUT_S) as r:
            np.testing.assert_array_equal(r["x"], np.arange(3))
        # A second worker of the service (an echo, no gate), ready before the kill; the
        # client heartbeats meanwhile (idle for the broker's client window, it would lose
        # its lease: a blocking client sends heartbeats only from inside its calls).
        _start_pumping(c, cluster.worker("echo", "--service", "gate", "--direct", *no_link, wait=False))
        xs = [np.full(5, i, np.int64) for i in range(64)]
        handles = [c.infer_stream("gate", {"x": x}) for x in xs]
        assert c.in_flight() == 64 and c.pinned("gate")
        gate.release(4)  # four finish on the lease; 60 are held at the doomed worker
        done = {}
        for i in range(4):
            with handles[i].result(timeout=TIMEOUT_S) as r:
                np.testing.assert_array_equal(r["x"], xs[i])
                done[i] = 1
        assert c.pinned_replies == 4
        doomed.kill()  # SIGKILL: the broker ends the lease with resend
        for i in range(4, 64):
            with handles[i].result(timeout=TIMEOUT_S) as r:
                np.testing.assert_array_equal(r["x"], xs[i])  # its own result
                done[i] = done.get(i, 0) + 1
        assert done == {i: 1 for i in range(64)} and c.in_flight() == 0
        assert c.pinned_replies == 4 and c.stray_replies == 0  # the 60 came through the broker
        # ... and the client pins again, to the live worker.
        _until_pinned(c, "gate")
        before = c.pinned_replies
        _echo(c, "gate", 7)
        assert c.pinned_replies == before + 1


def test_sigterm_of_the_pinned_worker_ends_the_lease_without_losing_a_request(cluster, gate):
    cluster.broker()
    stopping = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "16",
                              "--no-warmup", "--direct", env=gate.env, wait=False)
    gate.open()
    stopping.wait_ready()

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=30, pin=True) as c:
            first = c.infer_stream("gate", {"x": np.arange(3)})
            deadline = time.monotonic() + TIMEOUT_S
            while not c.pinned("gate"):
                assert time.monotonic() < deadline, "never pinned"
                await c.pump(0.05)
            # A second worker of the service (an echo, no gate) starts while the first request
            # waits at the gate: a batch that took that long is never run on the worker loop's
            # own thread again, so the loop hears SIGTERM while the gate holds requests.
            await asyncio.to_thread(cluster.worker, "echo", "--service", "gate", "--direct")
            gate.release(1)
            (await first.result(timeout=TIMEOUT_S)).release()
            xs = [np.full(6, i, np.int32) for i in range(8)]
            held = [asyncio.ensure_future(c.infer("gate", {"x": x})) for x in xs]  # all 8 on the lease
            await asyncio.sleep(0)
            assert c.in_flight() == 8
            stopping.p.send_signal(15)  # SIGTERM: the worker ends its lease, then finishes what it holds
            deadline = time.monotonic() + TIMEOUT_S
            while c.pinned("gate"):
                assert time.monotonic() < deadline, "the lease never ended"
                await c.pump(0.05)
            before = c.pinned_replies
            # New requests go through the broker meanwhile (the broker may hand some to the
            # stopping worker before it says goodbye: the gate lets those through too).
            later = [np.full(6, 100 + i, np.int32) for i in range(8)]
            more = [asyncio.ensure_future(c.infer("gate", {"x": x})) for x in later]
            await asyncio.sleep(0)
            gate.release(16)  # the held requests finish on the lease's connection
            for x, fut in zip(xs + later, held + more):
                out = await asyncio.wait_for(fut, TIMEOUT_S)
                np.testing.assert_array_equal(out["x"], x)
                out.release()
            await asyncio.to_thread(_plain_echo, cluster.frontend, "gate", 9)
            assert c.in_flight() == 0 and c.stray_replies == 0
            return c.pinned_replies - before

    pinned = asyncio.run(asyncio.wait_for(scenario(), 40))
    # The held ones the worker had read before SIGTERM finish on the lease's connection; any
    # it had not read yet are answered 503 "resend" and come through the broker (on a busy
    # machine all of them may be: the worker reads its direct socket between batches); the
    # later ones never go on the lease.  Either way none is lost and none is answered twice
    # (above); tests/e2e/test_leases_worker.py shows held work finishing on the connection.
    assert 0 <= pinned <= 8
    assert stopping.p.wait(TIMEOUT_S) == 0


def test_a_worker_sigkilled_while_it_drains_its_ended_lease_loses_no_request(cluster, gate):
    """SIGTERM ends the lease (its requests in flight are still the worker's to answer), then
    SIGKILL before it answers them: the broker sees the connection close without a
    DISCONNECT and tells the client again, with resend; every held request completes through
    the broker, on the other worker, exactly once."""
    cluster.broker()
    doomed = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "16",
                            "--no-warmup", "--direct", env=gate.env, wait=False)
    gate.open()
    doomed.wait_ready()

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=30, pin=True) as c:
            first = c.infer_stream("gate", {"x": np.arange(3)})
            deadline = time.monotonic() + TIMEOUT_S
            while not c.pinned("gate"):
                assert time.monotonic() < deadline, "never pinned"
                await c.pump(0.05)
            await asyncio.to_thread(cluster.worker, "echo", "--service", "gate", "--direct")
            gate.release(1)
            (await first.result(timeout=TIMEOUT_S)).release()
            xs = [np.full(5, i, np.int32) for i in range(6)]
            held = [asyncio.ensure_future(c.infer("gate", {"x": x})) for x in xs]  # on the lease
            await asyncio.sleep(0)
            assert c.in_flight() == 6
            # One of them at the gate (the first call was the other): without this the SIGTERM
            # could come before the worker read any of them, and the test see no held request.
            await asyncio.to_thread(gate.wait_entered, 2)
            doomed.p.send_signal(15)  # SIGTERM: the lease ends; the worker waits at its gate
            deadline = time.monotonic() + TIMEOUT_S
            while c.pinned("gate"):
                assert time.monotonic() < deadline, "the lease never ended"
                await c.pump(0.05)
            doomed.kill()  # SIGKILL before it answered what it holds
            for x, fut in zip(xs, held):
                out = await asyncio.wait_for(fut, TIMEOUT_S)
                np.testing.assert_array_equal(out["x"], x)
                out.release()
            assert c.in_flight() == 0 and c.stray_replies == 0

    asyncio.run(asyncio.wait_for(scenario(), 40))


# ------------------------------------------------------------------ a broker restart under pinned calls

N_HELD = 12


def _runs(log) -> dict[int, int]:
    """tag -> how many times the `counted` model ran it (tests/e2e/gate_model.py)."""
    runs: dict[int, int] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            tag = int(line.split()[1])
            runs[tag] = runs.get(tag, 0) + 1
    return runs


def _counted_workers(cluster, gate, log, n: int, *extra: str) -> list:
    env = {**gate.env, "RUN_LOG": str(log)}
    # Credit 40: a lease holds at most half of it, so all N_HELD fit on the lease.
    workers = [cluster.worker("gate_model:counted", "--service", "gate", "--max-batch", "1", "--credit", "40",
                              "--direct", *extra, env=env) for _ in range(n)]
    gate.open()  # (the workers opened the FIFO read-write at load: this returns at once)
    return workers


def _restart_broker(cluster, old, *extra: str) -> None:
    old.kill()  # SIGKILL: no goodbye to anyone; the worker and the client's direct link live on
    cluster.broker(*extra)  # the same endpoints


@pytest.mark.parametrize("link", [True, False], ids=["link", "ipc"])  # the local link, or the ipc direct socket
def test_a_broker_restart_runs_each_pinned_call_once_on_its_live_worker(cluster, gate, tmp_path, link):
    """SIGKILL the broker while a pinned client has N_HELD calls in flight on a live worker
    (one running at the gate, the rest queued there), start a new one on the same
    endpoints, and let the client learn of it before the gate opens: every call gets its
    own result once, and each ran once.  Before, the client voided its lease at the restart
    and sent every call again through the new broker while the worker (alive, its direct
    connection up) still ran them: the one running ran twice (every run here)."""
    log = tmp_path / "runs.log"
    broker = cluster.broker()
    _counted_workers(cluster, gate, log, 1, *(() if link else ("--no-link",)))
    with Client(cluster.frontend, timeout=30, pin=N_HELD) as c:
        first = c.infer_stream("gate", {"x": np.full(5, 1000, np.int64)})  # asks for the lease
        _pump_until(c, lambda: c.pinned("gate"), "the lease")
        gate.release(1)
        with first.result(timeout=TIMEOUT_S) as r:
            assert int(r["x"][0]) == 1000
        xs = [np.full(5, i, np.int64) for i in range(N_HELD)]
        handles = [c.infer_stream("gate", {"x": x}) for x in xs]
        assert c.in_flight() == N_HELD and c.pinned("gate")
        _pump_until(c, lambda: 0 in _runs(log), "the first held call at the gate")
        _restart_broker(cluster, broker)
        _pump_until(c, lambda: c.broker_restarts == 1, "the client hearing of the restart")
        gate.release(2 * N_HELD)  # room for a second run of each: one would show in the log
        for i, h in enumerate(handles):
            with h.result(timeout=TIMEOUT_S) as r:
                np.testing.assert_array_equal(r["x"], xs[i])  # its own result
        # A call through the new broker after them all: the worker reads its sockets in
        # order, so a second run of one of them sent before it would be in the log by now.
        with c.infer("gate", {"x": np.full(5, 2000, np.int64)}, timeout=TIMEOUT_S) as r:
            assert int(r["x"][0]) == 2000
        runs = _runs(log)
        assert runs == {1000: 1, 2000: 1, **{i: 1 for i in range(N_HELD)}}, runs
        assert c.in_flight() == 0 and c.stray_replies == 0 and c.pinned_replies >= 1


def test_a_broker_restart_runs_each_pinned_call_of_an_async_client_once_with_two_workers(cluster, gate, tmp_path):
    """The AsyncClient, two workers of the service (what its worker refuses may run on
    either), and the running call let through as soon as the new broker is up, before the
    client heard of it (it heartbeats every 3 s, which the brokers' 20 s client window
    allows): its result comes on the lease; the worker, which heard of the new broker
    first, then refuses what it held unstarted (503: it lost its broker), and each of those
    goes through the broker once, after the broker's next heartbeat answer.  Before, sent
    at once, it reached the new broker and started; the answer naming the new broker a
    moment later had it sent again, and it ran twice."""
    log = tmp_path / "runs.log"
    window = ("--heartbeat-liveness", "100")  # 0.2 s x 100: the client heartbeats at its own pace
    broker = cluster.broker(*window)
    _counted_workers(cluster, gate, log, 2)

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=30, pin=N_HELD, heartbeat_interval=3.0) as c:
            first = c.infer_stream("gate", {"x": np.full(5, 1000, np.int64)})
            deadline = time.monotonic() + TIMEOUT_S
            while not c.pinned("gate"):
                assert time.monotonic() < deadline, "never pinned"
                await c.pump(0.05)
            gate.release(1)
            (await first.result(timeout=TIMEOUT_S)).release()
            xs = [np.full(5, i, np.int64) for i in range(N_HELD)]
            held = [asyncio.ensure_future(c.infer("gate", {"x": x})) for x in xs]
            await asyncio.sleep(0)
            assert c.in_flight() == N_HELD
            deadline = time.monotonic() + TIMEOUT_S
            while 0 not in _runs(log):
                assert time.monotonic() < deadline, "no held call reached the gate"
                await c.pump(0.05)
            await asyncio.to_thread(_restart_broker, cluster, broker, *window)
            gate.release(1)  # the running one
            out = await asyncio.wait_for(held[0], TIMEOUT_S)
            np.testing.assert_array_equal(out["x"], xs[0])
            out.release()
            # Until the client has heard of the new broker and the refused calls reach a
            # gate again (through it): a second copy of one would be sent by then.
            deadline = time.monotonic() + TIMEOUT_S
            while c.broker_restarts < 1 or not set(_runs(log)) - {0, 1000}:
                assert time.monotonic() < deadline, ("no restart heard, or no refused call through the new broker",
                                                     c.broker_restarts, _runs(log))
                await c.pump(0.05)
            gate.release(2 * N_HELD)
            for x, fut in zip(xs[1:], held[1:]):
                out = await asyncio.wait_for(fut, TIMEOUT_S)
                np.testing.assert_array_equal(out["x"], x)
                out.release()
            for tag in (2000, 2001):  # after them all, through the new broker, on each worker
                (await c.infer("gate", {"x": np.full(5, tag, np.int64)}, timeout=TIMEOUT_S)).release()
            return c.in_flight(), c.stray_replies, c.pinned_replies

    in_flight, strays, pinned = asyncio.run(asyncio.wait_for(scenario(), 40))
    runs = _runs(log)
    assert {t: n for t, n in runs.items() if t < 1000} == {i: 1 for i in range(N_HELD)}, runs
    assert runs[1000] == 1 and in_flight == 0 and strays == 0 and pinned >= 1


@pytest.mark.parametrize("link", [True, False], ids=["link", "ipc"])
def test_a_pinned_worker_killed_with_the_broker_has_its_calls_sent_through_the_new_one(cluster, gate, tmp_path,
                                                                                        link):
    """The broker and the leased worker SIGKILLed together (a host's processes restarted),
    a new broker started: no broker is left to say the worker died (the new one never knew
    the lease), so the client watches the lease's connection itself (the link's close; on
    the ipc direct socket, a monitor of the DEALER's connection): the calls on it go through
    the new broker, to the other worker, once each (the one the dead worker was running may
    have run there too).  Without the ipc monitor they waited for their deadlines."""
    log = tmp_path / "runs.log"
    no_link = () if link else ("--no-link",)
    broker = cluster.broker()
    [doomed] = _counted_workers(cluster, gate, log, 1, *no_link)
    with Client(cluster.frontend, timeout=30, pin=N_HELD) as c:
        first = c.infer_stream("gate", {"x": np.full(5, 1000, np.int64)})
        _pump_until(c, lambda: c.pinned("gate"), "the lease")
        gate.release(1)
        with first.result(timeout=TIMEOUT_S) as r:
            assert int(r["x"][0]) == 1000
        # The other worker (counted too, at the same gate), ready before the kills.
        env = {**gate.env, "RUN_LOG": str(log)}
        _start_pumping(c, cluster.worker("gate_model:counted", "--service", "gate", "--max-batch", "1", "--credit",
                                         "40", "--direct", *no_link, env=env, wait=False))
        xs = [np.full(5, i, np.int64) for i in range(N_HELD)]
        handles = [c.infer_stream("gate", {"x": x}) for x in xs]
        assert c.in_flight() == N_HELD and c.pinned("gate")
        _pump_until(c, lambda: 0 in _runs(log), "the first held call at the gate")
        broker.kill()  # first: the old broker must not see the worker's end (it would say so)
        doomed.kill()
        cluster.broker()
        gate.release(2 * N_HELD)
        for i, h in enumerate(handles):
            with h.result(timeout=TIMEOUT_S) as r:
                np.testing.assert_array_equal(r["x"], xs[i])
        runs = _runs(log)
        assert {t: n for t, n in runs.items() if 0 < t < 1000} == {i: 1 for i in range(1, N_HELD)}, runs
        assert 1 <= runs[0] <= 2 and c.in_flight() == 0 and c.broker_restarts == 1


# ------------------------------------------------------------------ streams pin by default (issue 13)

def _frame(i: int) -> dict:
    return {"x": np.full(3, i, np.int16)}


def _check(r, i: int) -> None:
    with r:
        np.testing.assert_array_equal(r["x"], np.full(3, i, np.int16))


def test_a_stream_of_a_plain_client_pins_its_service(cluster):
    """`Client(endpoint)` and `AsyncClient(endpoint)`, no `pin`: a stream asks for a lease on
    its service with its first frame, and its frames go on the lease once it is granted."""
    cluster.broker()
    cluster.worker("echo", "--direct")
    with Client(cluster.frontend, timeout=TIMEOUT_S) as c:
        wait_service(c, "echo")
        with c.stream("echo", latest_wins=False, max_in_flight=2) as st:
            deadline = time.monotonic() + TIMEOUT_S
            i = 0
            while not c.pinned("echo"):  # the first frames go through the broker meanwhile
                assert time.monotonic() < deadline, "the stream never pinned"
                st.send(_frame(i))
                _check(st.recv(timeout=TIMEOUT_S), i)
                i += 1
                if not c.pinned("echo"):
                    c.pump(0.05)  # a LEASED on its way is routed
            before = c.pinned_replies
            for k in range(10):
                st.send(_frame(100 + k))
            for k in range(10):
                _check(st.recv(timeout=TIMEOUT_S), 100 + k)
            assert c.pinned_replies - before == 10
        assert c.stray_replies == 0 and c.in_flight() == 0
        _plain_echo(cluster.frontend, "echo", 3)

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=TIMEOUT_S) as ac:
            st = ac.stream("echo", latest_wins=False, max_in_flight=4)
            deadline = time.monotonic() + TIMEOUT_S
            i = 0
            while not ac.pinned("echo"):
                assert time.monotonic() < deadline, "the async stream never pinned"
                st.send(_frame(i))
                _check(await st.recv(TIMEOUT_S), i)
                i += 1
                if not ac.pinned("echo"):
                    await ac.pump(0.05)
            before = ac.pinned_replies
            for k in range(12):
                st.send(_frame(200 + k))
            for k in range(12):
                _check(await st.recv(TIMEOUT_S), 200 + k)
            assert ac.pinned_replies - before == 12 and ac.stray_replies == 0
            st.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_pinned_stream_longer_than_the_liveness_window_keeps_its_worker_alive(cluster):
    """A leased stream's partials go on the worker's direct connection, never to the broker,
    and the heartbeat thread holds the worker's socket only while the model computes: a model
    that yields at once left the broker hearing nothing for the whole stream, and past its
    liveness window (0.2 s x 3 here) it presumed the worker dead, ended the lease with
    `resend` and the stream failed at its client with WorkerFailed ("the pinned worker
    failed after request ... had streamed results"; 7 of 12 streams of 30,000 partials on a
    loaded 2-core machine, and this test 6 of 6 times without the extra load).  The worker now
    heartbeats between partials."""
    broker = cluster.broker()
    cluster.worker("faulty_model:streaming", "--service", "s", "--direct")
    x = np.zeros(1, np.int64)
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        deadline = time.monotonic() + TIMEOUT_S
        while not c.pinned("s"):
            assert time.monotonic() < deadline, "never pinned"
            with c.infer_stream("s", {"x": x}, meta={"do": "many", "n": 1}, reply="inline") as h:
                [r.release() for r in h]
            c.pump(0.05)
        before = c.pinned_replies
        n = 0
        with c.infer_stream("s", {"x": x}, meta={"do": "for", "s": 2.0}, reply="inline") as h:
            for r in h:
                r.release()
                n += 1
        assert n > 1 and c.pinned_replies - before == n, (n, c.pinned_replies - before)
    assert "presumed dead" not in broker.stderr(None)


def test_a_stream_against_workers_without_direct_stays_brokered(cluster):
    cluster.broker()
    cluster.worker("echo")  # no --direct: the ask is refused
    with Client(cluster.frontend, timeout=TIMEOUT_S) as c:
        wait_service(c, "echo")
        with c.stream("echo", latest_wins=False, max_in_flight=2) as st:
            for i in range(8):
                st.send(_frame(i))
            for i in range(8):
                _check(st.recv(timeout=TIMEOUT_S), i)
        c.mmi_service("echo")  # a barrier: the LEASE's refusal came before this answer
        assert not c.pinned("echo") and c.pinned_replies == 0 and c.stray_replies == 0

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=TIMEOUT_S) as ac:
            st = ac.stream("echo", latest_wins=False, max_in_flight=3)
            for i in range(8):
                st.send(_frame(i))
            for i in range(8):
                _check(await st.recv(TIMEOUT_S), i)
            st.close()
            await ac.mmi_service("echo")
            assert not ac.pinned("echo") and ac.pinned_replies == 0 and ac.stray_replies == 0

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_model_that_refills_its_output_buffer_never_sends_one_reply_with_anothers_data(cluster, tmp_path):
    # A pinned client's replies go on the worker's local link, which keeps views of what the
    # kernel has not taken yet (a client that is behind).  An output between pyzmq's copy
    # threshold and the inline size, from a buffer the model fills again for its next batch,
    # was sent as a view: queued replies carried a later request's values (found by the data
    # hunt: 15 of 40 outputs of 60 KB).  A leased reply's model-owned output is copied.
    log = tmp_path / "calls.log"
    cluster.broker()
    cluster.worker("reuse_model:factory", "--direct", env={"REUSE_LOG": str(log)})
    n = 15000  # 60 KB of float32: over the inline-copy size, under pyzmq's copy threshold

    def ran() -> int:
        return len(log.read_text().splitlines()) if log.exists() else 0

    bad = []
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=True) as c:
        wait_service(c, "reuse")
        deadline = time.monotonic() + TIMEOUT_S
        while not c.pinned("reuse"):
            assert time.monotonic() < deadline, "never pinned"
            c.infer("reuse", {"x": np.zeros(n, np.float32)}, reply="inline").release()
            c.pump(0.05)
        for rnd in range(4):
            before = ran()
            handles = [(rnd * 10 + i, c.infer_stream("reuse", {"x": np.full(n - i, rnd * 10 + i, np.float32)},
                                                     reply="inline")) for i in range(8)]
            deadline = time.monotonic() + 2.0
            while ran() < before + 8 and time.monotonic() < deadline:
                c.pump(0.02)  # sends what waits to go; the replies pile up at the worker meanwhile
            for v, h in handles:
                with h.result(timeout=TIMEOUT_S) as r:
                    if not np.all(r["y"] == v):
                        bad.append((v, np.unique(r["y"])[:4].tolist()))
        assert c.pinned_replies >= 32
    assert bad == []


def test_a_stream_dropped_unclosed_ends_its_lease(cluster):
    """A stream the application drops without close() (its own error first, no `with`)
    kept its service pinned for the client's life: the lease and the worker's credit it
    holds stayed, and the client's plain calls to the service went on it (the interruption
    hunt).  Dropped, it closes as a reply handle does."""
    cluster.broker()
    cluster.worker("echo", "--direct")
    with Client(cluster.frontend, timeout=TIMEOUT_S) as c:
        wait_service(c, "echo")

        def frames():
            st = c.stream("echo", latest_wins=False)
            for i in range(3):
                st.send({"x": np.full(3, i, np.int16)})
                with st.recv(timeout=TIMEOUT_S) as r:
                    np.testing.assert_array_equal(r["x"], np.full(3, i, np.int16))
            _pump_until(c, lambda: c.pinned("echo"), "the stream's lease")
            raise RuntimeError("the application's own error, before close()")

        with pytest.raises(RuntimeError):
            frames()
        _pump_until(c, lambda: not c.pinned("echo"), "the dropped stream's lease ending")
        before = c.pinned_replies
        for i in range(5):
            _echo(c, "echo", i)
        assert c.pinned_replies == before  # a client made without pin: through the broker

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=TIMEOUT_S) as ac:
            async def frames():
                st = ac.stream("echo", latest_wins=False)
                for i in range(3):
                    st.send({"x": np.full(3, i, np.int16)})
                    (await st.recv(timeout=TIMEOUT_S)).release()
                deadline = time.monotonic() + TIMEOUT_S
                while not ac.pinned("echo"):
                    assert time.monotonic() < deadline, "the stream never pinned"
                    await ac.pump(0.05)
                raise RuntimeError("boom")

            with pytest.raises(RuntimeError):
                await frames()
            deadline = time.monotonic() + TIMEOUT_S
            while ac.pinned("echo"):
                assert time.monotonic() < deadline, "the dropped stream's lease never ended"
                await ac.pump(0.05)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_lease_slot_of_a_call_whose_reply_was_lost_is_free_again(cluster):
    """A reply lost on the client's side (a Ctrl-C in the receive) left its call's lease
    slot taken for the lease's life: the worker knows nothing of the CANCEL the call's
    deadline sends, so no FINAL ever frees it, and once every slot was so taken each call
    went through the broker (the interruption hunt: 8 of 8 after 300 Ctrl-Cs).  A slot
    given up that long ago (the liveness window) is free again."""
    cluster.broker()
    cluster.worker("echo", "--direct")
    with Client(cluster.frontend, timeout=TIMEOUT_S, pin=1, heartbeat_interval=0.1) as c:
        wait_service(c, "echo")
        _until_pinned(c, "echo")
        core = c._core
        real = core.on_message
        lost = []

        def losing(frames, now, direct=False, pin=None):
            if pin is not None and not lost:
                lost.append(frames)  # the pinned call's FINAL, dropped as an interrupt would
                return []
            return real(frames, now, direct, pin)

        core.on_message = losing
        with pytest.raises(DeadlineExceeded):
            c.infer("echo", {"x": np.arange(4)}, timeout=0.3)
        assert lost
        core.on_message = real
        before = c.pinned_replies
        deadline = time.monotonic() + TIMEOUT_S
        while c.pinned_replies == before:  # brokered while the slot is taken, then pinned again
            assert time.monotonic() < deadline, "the lease's one slot stayed taken"
            _echo(c, "echo", 1)
        assert c.pinned("echo")


def test_a_streams_pinned_frames_wait_behind_its_own_brokered_ones(cluster, monkeypatch, tmp_path):
    """A stream with more frames in flight than its lease has slots (a worker of a model that
    does not batch grants one) sends the rest through the broker, which may hand them to
    the leased worker; a pinned frame arriving behind one was bounced (429, "another's
    batch") as if it were another client's, went through the broker as well, and most of
    the stream came off its lease (the pause hunt: 11 of 30 frames pinned).  Its client's
    own request is not another's: the frame waits, as behind the lease's own."""
    from client_sdk import pins

    cluster.broker()
    cluster.worker("gate_model:sleepy", "--direct", "--service", "sleepy", env={"SLEEPY_LOG": str(tmp_path / "runs")})
    bounced = []
    real = pins.PinEvents._pin_bounce

    def counted(self, call, pin, err, now):
        bounced.append(err.code)
        return real(self, call, pin, err, now)

    monkeypatch.setattr(pins.PinEvents, "_pin_bounce", counted)
    with Client(cluster.frontend, timeout=TIMEOUT_S) as c:
        wait_service(c, "sleepy")
        with c.stream("sleepy", latest_wins=False, max_in_flight=4) as st:
            deadline = time.monotonic() + TIMEOUT_S
            while not c.pinned("sleepy"):
                assert time.monotonic() < deadline, "the stream never pinned"
                st.send({"x": np.zeros(2)})
                st.recv(timeout=TIMEOUT_S).release()
                c.pump(0.05)
            sent = got = 0
            while got < 16:
                while sent < 16 and sent - got < 4:
                    st.send({"x": np.array([0.03, sent])})
                    sent += 1
                with st.recv(timeout=TIMEOUT_S) as r:
                    assert r["x"][1] == got
                got += 1
    assert bounced == []


def test_a_pinned_client_that_closes_leaves_nothing_queued_to_run_for_it(cluster, gate):
    # Found by the leases audit: a pinned client closed with calls queued at its worker (a
    # close without linger cancels nothing) left them to run for nobody, where a brokered
    # client's DISCONNECT drops them at the broker.  The client's DISCONNECT on the lease's
    # connection now does the same at the worker.
    cluster.broker()
    w = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "16",
                       "--no-warmup", "--direct", "--log-level", "INFO", env=gate.env, wait=False)
    gate.open()
    w.wait_ready()
    c = Client(cluster.frontend, timeout=30, pin=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not c.pinned("gate"):
            assert time.monotonic() < deadline, "never pinned"
            gate.release(1)
            with c.infer("gate", {"x": np.arange(3)}, timeout=TIMEOUT_S):
                pass
            if not c.pinned("gate"):
                c.pump(0.05)
        ran = gate.entered()
        calls = [c.prepare("gate", {"x": np.full(3, i)}) for i in range(4)]
        for call in calls:
            assert c.submit(call, timeout=TIMEOUT_S)
        gate.wait_entered(ran + 1)  # the first runs (held at the gate), three wait behind it
        mark = w.logged
        c.close(0)
        gate.release(1)  # the running one ends (the worker reads its sockets between batches)
        w.wait_log("request done", after=mark)
    finally:
        c.close(0)
    # The three queued went with the client (cancelled at the worker when it had read them,
    # "its client left"; dropped unread with the connection when it had not): none reaches
    # the gate.  A call through the broker, let through, runs after whatever was still
    # queued: had one of the three run, it would hold the gate and this call would wait.
    gate.release(1)
    with Client(cluster.frontend, timeout=TIMEOUT_S) as other:
        with other.infer("gate", {"x": np.arange(3)}):
            pass
    assert gate.entered() == ran + 2, (ran, gate.entered())
