"""Restarts with real processes: the broker SIGKILLed and started again on the same endpoints,
and workers stopped with SIGTERM while they hold requests (docs/operations.md)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import time

import numpy as np
import pytest

from client_sdk import Client
from tests.e2e.conftest import wait_service


def _echo_round(c: Client, n: int) -> None:
    for i in range(n):
        x = np.full(16, i % 251, np.uint8)
        with c.infer("echo", {"x": x}, timeout=10) as r:
            np.testing.assert_array_equal(r["x"], x)


def test_workers_survive_a_broker_restart_within_the_liveness_window(cluster):
    broker = cluster.broker()
    workers = [cluster.worker("echo"), cluster.worker("echo")]
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        _echo_round(c, 20)
    broker.kill()  # SIGKILL: no goodbye to anyone
    t0 = time.monotonic()
    cluster.broker()  # same endpoints, well inside the workers' 0.6 s liveness window
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        back_after = time.monotonic() - t0
        _echo_round(c, 20)
    assert all(w.p.poll() is None for w in workers), [w.stderr() for w in workers]
    assert back_after < 10.0, back_after


def test_workers_survive_a_broker_restart_past_the_liveness_window(cluster):
    broker = cluster.broker()
    worker = cluster.worker("echo")
    broker.kill()
    worker.wait_log("reconnecting")  # it noticed the silence and reconnects with nobody there
    cluster.broker()
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        _echo_round(c, 5)
    assert worker.p.poll() is None, worker.stderr()


def test_a_broker_restart_under_load_loses_nothing_and_duplicates_nothing(cluster):
    """SIGKILL the broker while requests are in flight and start it again at once: each call
    gets exactly its own result (the client resends what the dead broker held)."""
    import asyncio

    from client_sdk import AsyncClient

    broker = cluster.broker()
    workers = [cluster.worker("echo"), cluster.worker("echo")]
    per_task, tasks = 40, 8
    restarted = {}

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=20, heartbeat_interval=0.2) as c:
            while not await c.mmi_service("echo"):
                await asyncio.sleep(0.01)
            done = []

            async def one_stream(k: int):
                for i in range(per_task):
                    x = np.full(4, k * 1000 + i, np.int64)
                    out = await c.infer("echo", {"x": x})
                    np.testing.assert_array_equal(out["x"], x)  # its own result, not another's
                    out.release()
                    done.append((k, i))
                    if len(done) == tasks * per_task // 4 and not restarted:
                        broker.kill()  # mid-load: requests are in flight at the broker and workers
                        restarted["t"] = time.monotonic()
                        await asyncio.to_thread(cluster.broker)
                        restarted["back"] = time.monotonic() - restarted["t"]

            await asyncio.wait_for(asyncio.gather(*(one_stream(k) for k in range(tasks))), 60)
            assert sorted(done) == [(k, i) for k in range(tasks) for i in range(per_task)]
            return c.broker_restarts

    assert asyncio.run(scenario()) == 1
    assert all(w.p.poll() is None for w in workers), [w.stderr() for w in workers]


def test_a_long_request_on_the_loop_thread_runs_exactly_once(cluster, tmp_path):
    """3x the liveness window (0.2 s x 3) on the worker loop's own thread: heartbeats go on
    meanwhile (gpu_worker.compute.LoopHeartbeats), so the broker never presumes the worker
    dead and never runs the request a second time on the other worker."""
    runs = tmp_path / "runs.log"
    cluster.broker()
    env = {"SLEEPY_LOG": str(runs)}
    workers = [cluster.worker("gate_model:sleepy", "--service", "sleepy", env=env) for _ in range(2)]
    with Client(cluster.frontend, timeout=30) as c:
        wait_service(c, "sleepy")
        x = np.array([1.8])
        with c.infer("sleepy", {"x": x}) as r:
            np.testing.assert_array_equal(r["x"], x)
        assert c.stray_replies == 0
    assert len(runs.read_text().split()) == 1, runs.read_text()
    assert all(w.p.poll() is None for w in workers), [w.stderr() for w in workers]


def test_a_sigkilled_local_worker_fails_over_when_its_connection_closes(cluster, gate):
    """Heartbeats of 10 s (30 s liveness): the broker still moves the dead worker's requests at
    once, because the closed connection names the worker (broker.connections).  The long
    window keeps "at once" far from "when liveness ran out" on a loaded machine."""
    import asyncio

    from client_sdk import AsyncClient

    cluster.broker("--heartbeat-interval", "10.0")
    doomed = cluster.worker("gate_model:factory", "--service", "echo", "--max-batch", "1", "--credit", "8",
                            "--no-warmup", "--heartbeat-interval", "10.0", env=gate.env, wait=False)
    gate.open()
    doomed.wait_ready()

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=45) as c:
            while not await c.mmi_service("echo"):
                await asyncio.sleep(0.01)
            xs = [np.full((16,), i, dtype=np.int32) for i in range(4)]
            tasks = [asyncio.create_task(c.infer("echo", {"x": x})) for x in xs]
            while c.in_flight() < len(xs):
                await asyncio.sleep(0)
            assert await c.mmi_service("echo")  # all four are at the doomed worker
            await asyncio.to_thread(cluster.worker, "echo", "--heartbeat-interval", "10.0")
            t0 = time.monotonic()
            doomed.kill()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 45)
            took = time.monotonic() - t0
            for x, r in zip(xs, results):
                np.testing.assert_array_equal(r["x"], x)
                r.release()
            return took

    took = asyncio.run(scenario())
    assert took < 10.0, f"fail-over took {took:.2f} s; the liveness window is 30 s"


_HOLDER = """
import sys, numpy as np
from client_sdk import Client
c = Client(sys.argv[1], timeout=10)
held = [c.infer("sleepy", {"x": np.zeros(1 << 16)}) for _ in range(8)]   # results kept, unreleased
print("HELD", flush=True)
sys.stdin.read()
"""


def _live_slots(owner_pid: int) -> int:
    from shm.gc import list_segments

    return sum(s.live_slots or 0 for s in list_segments() if s.owner_pid == owner_pid)


def test_a_killed_clients_results_are_reclaimed_from_the_output_ring(cluster, tmp_path):
    """The worker frees the output slots of a client that died within about a heartbeat
    interval, keyed on the pid the broker read from the client's connection."""
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT
    from tests.children import readline_within

    cluster.broker()
    w = cluster.worker("gate_model:sleepy", "--service", "sleepy", env={"SLEEPY_LOG": str(tmp_path / "runs")})
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "sleepy")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, cluster.frontend], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert readline_within(holder.stdout, 30, "the holder's HELD (its 8 calls answered)").strip() == b"HELD"
        worker_pid = int(w.field("pid"))
        assert _live_slots(worker_pid) >= 8
        holder.kill()
        holder.wait(10)
        t0 = time.monotonic()
        while _live_slots(worker_pid) > 0:  # a condition polled with a deadline, as wait_service does
            assert time.monotonic() - t0 < 10.0, f"{_live_slots(worker_pid)} output slots still held"
            time.sleep(0.02)
        # Within a few heartbeat intervals (0.2 s) even on a loaded machine; a worker that
        # reclaims only when an allocation finds its ring full never frees them.
        assert time.monotonic() - t0 < 5.0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        holder.stdin.close()
        holder.stdout.close()


def test_the_brokers_liveness_settings_reach_its_workers(cluster):
    """A broker configured for 0.2 s heartbeats and a worker started with 1 s: the worker
    takes the broker's settings from WELCOME and is never presumed dead for heartbeating
    too slowly (before, it was presumed dead and re-registered over and over)."""
    cluster.broker()  # 0.2 s x 3
    w = cluster.worker("echo", "--heartbeat-interval", "1.0", "--log-level", "INFO")
    w.wait_log("the broker sets liveness: heartbeat every 0.2 s")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        for _ in range(3):
            _echo_round(c, 5)
            # Idle for longer than the broker's window (0.6 s) but less than the worker's own
            # interval (1 s): only heartbeats at the broker's rate keep the worker registered.
            time.sleep(0.8)
        assert c.mmi_service("echo")
    w.terminate()
    assert "asked us to reconnect" not in w.stderr(), w.stderr()



def test_a_broker_outage_past_the_liveness_window_fails_calls_typed_then_recovers(cluster):
    """Past the client's liveness window (5 x 0.2 s) a waiting call gets BrokerUnreachable
    (not a 30 s timeout, never a silent loss); once the broker is back, calls succeed."""
    import pytest

    from client_sdk import BrokerUnreachable

    broker = cluster.broker()
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=30, heartbeat_interval=0.2) as c:
        wait_service(c, "echo")
        _echo_round(c, 3)
        broker.kill()
        t0 = time.monotonic()
        with pytest.raises(BrokerUnreachable):
            c.infer("echo", {"x": np.zeros(4)})
        assert time.monotonic() - t0 < 5.0
        cluster.broker()
        wait_service(c, "echo")
        _echo_round(c, 3)


def test_a_worker_registers_with_a_restarted_broker_at_once_not_at_its_next_heartbeat(cluster):
    """Its connection's monitor (polled by descriptor) says the connection came back: it
    registers again then, without waiting for a heartbeat (5 s here) to be refused."""
    slow = ("--heartbeat-interval", "5")
    broker = cluster.broker(*slow)
    worker = cluster.worker("echo", *slow)
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
    broker.kill()
    cluster.broker(*slow)
    t0 = time.monotonic()
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo", timeout=10)
        back_after = time.monotonic() - t0
        _echo_round(c, 3)
    assert worker.p.poll() is None, worker.stderr()
    assert back_after < 2.5, back_after  # a heartbeat would take up to 5 s


def test_a_stream_cut_by_a_broker_restart_leaves_no_output_slot_held(cluster, gate):
    """A stream's PARTIALs go through the broker.  The broker is SIGKILLed and started again
    mid-stream: the new one knows nothing of the stream, and drops what arrives for it.  The
    worker learns of the restart (the new broker answers its heartbeats with DISCONNECT)
    and ends the stream at its next partial without writing it: a PARTIAL written into its
    output ring and dropped would leave the slot lent to the (live) client for good."""
    from client_sdk import errors

    broker = cluster.broker()
    w = cluster.worker("gate_model:gated_stream", env=gate.env)
    gate.open()
    worker_pid = int(w.field("pid"))
    x = np.zeros(1 << 14, np.float32)  # 64 KiB: each partial is a slot of the worker's ring
    with Client(cluster.frontend, timeout=20) as c:
        wait_service(c, "gstream")
        call = c.infer_stream("gstream", {"x": x}, timeout=20)
        gate.release()
        first = next(call)
        assert float(first["x"][0]) == 0.0
        first.release()
        broker.kill()
        fresh = cluster.broker("--log-level", "INFO")
        fresh.wait_log("disconnecting worker")  # it has told the worker it does not know it
        gate.release()  # the next partial: computed, not written
        try:
            for part in call:  # it fails: a stream cannot be replayed after a restart
                part.release()
        except errors.InferenceError:
            pass
        t0 = time.monotonic()
        while _live_slots(worker_pid) > 0:
            assert time.monotonic() - t0 < 5.0, f"{_live_slots(worker_pid)} output slots still held"
            c.mmi_service("gstream")  # the client reads (and would release) what reaches it
            time.sleep(0.05)
        gate.release()  # a third byte, should anything still wait for it
        wait_service(c, "gstream")  # the worker registered with the new broker


def test_an_output_slot_whose_reply_was_lost_with_the_broker_goes_back(cluster, gate):
    """A FINAL relayed through the broker (no direct reply) names a slot of the worker's
    output ring, lent to the client.  The broker is stopped before it relays the FINAL, then
    SIGKILLed: the reply is lost, and the client never learns which slot it named.  The
    client sends the call again to the new broker and is answered; the old run's slot goes
    back at one of its next heartbeats (sent while calls wait), found by the request id it
    was lent for (its `lend_tag`), which the client gave up on.  Before, it stayed lent until
    the client exited."""
    import signal

    broker = cluster.broker()
    w = cluster.worker("gate_model:copying", "--service", "gate", "--max-batch", "1", "--no-warmup",
                       env=gate.env, wait=False)
    gate.open()
    w.wait_ready()
    worker_pid = int(w.field("pid"))
    x = np.arange(1 << 14, dtype=np.float32)  # 64 KiB: the reply is a slot of the worker's ring
    with Client(cluster.frontend, timeout=30, direct_reply=False) as c:
        wait_service(c, "gate")
        call = c.infer_stream("gate", {"x": x}, reply="shm")  # (a handle on a plain call)
        gate.wait_entered(1)
        os.kill(broker.p.pid, signal.SIGSTOP)
        gate.release()  # the reply is written, lent to us, and sent to a broker that reads nothing
        t0 = time.monotonic()
        while _live_slots(worker_pid) < 1:
            assert time.monotonic() - t0 < 10.0, "the worker never wrote its reply"
            time.sleep(0.01)  # polling the worker's ring (a condition, not a delay)
        broker.kill()
        cluster.broker()
        gate.release()  # for the call sent again (the client sends it as it waits for it)
        with call.result(timeout=30) as r:
            np.testing.assert_array_equal(r["x"], x)
        assert c.broker_restarts == 1
        t0 = time.monotonic()
        while _live_slots(worker_pid) > 0:
            assert time.monotonic() - t0 < 10.0, f"{_live_slots(worker_pid)} output slots still held"
            gate.release()
            c.infer("gate", {"x": x[:4]}).release()  # heartbeats go out while calls wait
        assert c._core.given_up_returned == 1


def test_replies_after_their_deadline_leave_no_output_slot_held(cluster):
    """A request's deadline passes while its worker runs it: the client is answered
    DEADLINE_EXCEEDED, and the worker's reply, if it comes, is late.  Through the broker
    (no direct reply here), a late reply that names a slot of the worker's output ring is
    still forwarded to its client, which gives the slot back: dropped, the slot stayed lent
    to the live client for good.  Deadlines spread around the model's 50 ms, so that some
    replies are written before the worker hears of the cancel."""
    from client_sdk import errors

    cluster.broker()
    w = cluster.worker("tests.bench.slow_model:factory")
    worker_pid = int(w.field("pid"))
    x = np.zeros(1 << 14, np.float32)  # 64 KiB: the reply is a slot of the worker's ring
    with Client(cluster.frontend, timeout=20, direct_reply=False) as c:
        wait_service(c, "slow")
        late = 0
        for i in range(24):
            try:
                c.infer("slow", {"x": x}, timeout=0.035 + 0.002 * i, reply="shm").release()
            except errors.DeadlineExceeded:
                late += 1
        assert late > 0
        t0 = time.monotonic()
        while _live_slots(worker_pid) > 0:
            assert time.monotonic() - t0 < 5.0, f"{_live_slots(worker_pid)} output slots still held"
            c.mmi_service("slow")  # the client reads (and releases) the late replies
            time.sleep(0.05)


def test_a_call_the_dead_broker_held_is_sent_again_once_the_new_one_connects_not_at_the_next_heartbeat(cluster):
    """A blocking client's call held by a broker that is SIGKILLed and started again on the
    same ipc endpoint is sent again as soon as the client's connection to the new broker is
    up (its monitor says so: the twin heartbeats at once, and the answer names the new
    broker), not at its next heartbeat: 30 s here, past the call's 25 s deadline (room for a
    loaded machine to start a broker and a worker), so without that wake-up the call fails.  (With the default 1 s a call stalled up to a second after
    the broker was back: the stalls hunt, python -m bench.stalls --events broker.)"""
    slow = ("--heartbeat-interval", "30")
    broker = cluster.broker(*slow, "--service-grace", "60", "--log-level", "DEBUG")
    x = np.arange(16, dtype=np.int32)
    with Client(cluster.frontend, timeout=60, heartbeat_interval=30) as c:
        # The broker's name known first (its MMI answer comes after its answer to the hello):
        # a broker killed before that answer left it is the next test's.
        assert c.mmi_service("echo", timeout=10) is False
        handle = c.infer_stream("echo", {"x": x}, timeout=25)  # no worker yet: it waits in the broker's queue
        broker.wait_log("request received")
        broker.kill()
        cluster.broker(*slow)
        cluster.worker("echo", *slow)
        with handle.result(timeout=30) as r:
            np.testing.assert_array_equal(r["x"], x)
        assert c.broker_restarts == 1


@pytest.mark.parametrize("blocking", [True, False], ids=["Client", "AsyncClient"])
def test_a_call_sent_to_a_broker_that_died_before_it_ever_answered_is_sent_again(cluster, blocking):
    """A client whose broker died before its answer to the client's first heartbeat left it
    (a CI run: SIGKILLed just after it logged the request) never knew that broker: the new
    broker's first answer was taken for the broker the call went to, nothing was sent again,
    and the call waited out its 25 s deadline.  Here the dead broker is a bare ROUTER that
    reads the hello and the request and closes; the client's monitor saw two handshakes before
    any answer, so the answers that follow send the call again, once."""
    import zmq

    from broker import protocol as P
    from client_sdk import AsyncClient

    x = np.arange(16, dtype=np.int32)
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)
    mute.setsockopt(zmq.LINGER, 0)
    opts = dict(timeout=60, heartbeat_interval=30)

    def silence_then_restart():
        got = []
        while P.C_REQUEST not in got:  # the hello (a HEARTBEAT, two from an AsyncClient), the REQUEST
            assert mute.poll(10_000), got
            frames = mute.recv_multipart()
            got.append(frames[frames.index(P.MDPC) + 1])
        assert got[0] == P.C_HEARTBEAT and got[-1] == P.C_REQUEST, got  # none answered
        mute.close()
        cluster.broker("--heartbeat-interval", "30")
        cluster.worker("echo", "--heartbeat-interval", "30")

    try:
        mute.bind(cluster.frontend)
        if blocking:
            with Client(cluster.frontend, **opts) as c:
                handle = c.infer_stream("echo", {"x": x}, timeout=25)
                silence_then_restart()
                with handle.result(timeout=30) as r:
                    np.testing.assert_array_equal(r["x"], x)
                counts = c.broker_reconnects, c.resent_calls
        else:
            async def main():
                async with AsyncClient(cluster.frontend, **opts) as a:
                    call = asyncio.ensure_future(a.infer("echo", {"x": x}, timeout=25))
                    await asyncio.get_running_loop().run_in_executor(None, silence_then_restart)
                    r = await call
                    np.testing.assert_array_equal(r["x"], x)
                    r.release()
                    return a.broker_reconnects, a.resent_calls
            counts = asyncio.run(main())
        assert counts == (1, 1), counts
    finally:
        mute.close()
        ctx.term()


@pytest.mark.parametrize("blocking", [True, False], ids=["Client", "AsyncClient"])
def test_a_call_that_times_out_against_a_dead_broker_says_the_broker_is_silent(cluster, blocking):
    """A call whose timeout is shorter than the liveness window, made once the broker was
    SIGKILLed: its error advised "raise `timeout`, lower the load, or add workers" though
    nothing, not even an answer to its heartbeats, had come.  It says the broker is silent
    now, and what the kernel says of the ipc endpoint (nothing listening)."""
    from client_sdk import AsyncClient, DeadlineExceeded

    broker = cluster.broker("--heartbeat-interval", "1")  # its client window 5 s: the client's period stays 1 s
    x = np.arange(4, dtype=np.int32)
    # The liveness window 5 s from the last word; two periods 2 s from the first unanswered
    # heartbeat (sent up to a period after the call): about a second of room either way.
    opts = dict(timeout=4.0, heartbeat_interval=1.0)

    def check(said):
        assert "nothing has come from the broker at" in said and "nothing listens on" in said, said
        assert "raise `timeout`" not in said, said

    if blocking:
        with Client(cluster.frontend, **opts) as c:
            assert c.mmi_service("echo", timeout=10) is False  # heard from
            broker.kill()
            with pytest.raises(DeadlineExceeded) as e:
                c.infer("echo", {"x": x})
            check(str(e.value))
    else:
        async def main():
            async with AsyncClient(cluster.frontend, **opts) as a:
                assert await a.mmi_service("echo", timeout=10) is False
                await asyncio.get_running_loop().run_in_executor(None, broker.kill)
                with pytest.raises(DeadlineExceeded) as e:
                    await a.infer("echo", {"x": x})
                return str(e.value)
        check(asyncio.run(main()))


def test_stream_frames_that_wait_out_a_broker_outage_say_the_broker_is_silent(cluster):
    """Frames of a stream that waited for room while the broker was down (its sent frame
    stuck with it) were told that the model is slower than the frames come, to raise
    max_in_flight or add workers (the rolling-restart audit: a 6 s outage).  They say the
    broker is silent now, as the sent frame's error does."""
    from client_sdk import DeadlineExceeded

    broker = cluster.broker("--heartbeat-interval", "1")
    cluster.worker("echo")
    x = np.arange(4, dtype=np.int32)
    with Client(cluster.frontend, timeout=30, heartbeat_interval=1.0) as c:
        wait_service(c, "echo")
        with c.stream("echo", latest_wins=False, max_in_flight=1, pin=False, timeout=4.0) as st:
            st.send({"x": x})
            with st.recv(timeout=10) as r:
                np.testing.assert_array_equal(r["x"], x)
            broker.kill()
            for _ in range(3):
                st.send({"x": x})  # the first goes to the dead broker, the others wait for room
            errors = []
            for _ in range(2):  # the sent frame's error, then the two never sent, as one
                with pytest.raises(DeadlineExceeded) as e:
                    st.recv(timeout=10)
                errors.append(str(e.value))
    assert "never sent" not in errors[0] and "never sent" in errors[1], errors
    for said in errors:
        assert "nothing has come from the broker at" in said, said
        assert "raise max_in_flight" not in said and "raise `timeout`" not in said, said


def test_sigterm_drains_a_standalone_broker_and_its_successor_runs_what_stayed_queued(cluster, gate):
    """A broker without pools stopped at once on SIGTERM: the request its worker ran was lost
    with it (its reply came through the broker) and ran again after the restart, its caller
    waiting meanwhile (the operations-docs audit).  Now it drains: nothing new goes to the
    worker, the request it holds is answered through the old broker, which then exits 0;
    the request still queued goes with it, and the client sends it to the next broker."""
    import signal

    from tests.e2e.test_metrics import get

    broker = cluster.broker("--log-level", "info", "--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    worker = cluster.worker("gate_model:copying", "--service", "gate", "--max-batch", "1", "--credit", "1",
                            "--no-direct-reply", "--no-warmup", env=gate.env, wait=False)
    gate.open()
    worker.wait_ready()
    x0, x1 = np.arange(16, dtype=np.int32), np.arange(16, 32, dtype=np.int32)
    with Client(cluster.frontend, timeout=30) as c:
        wait_service(c, "gate")
        assert get(base, "/v2/health/ready")[0] == 200
        held = c.infer_stream("gate", {"x": x0})
        gate.wait_entered(1)  # the worker runs it
        queued = c.infer_stream("gate", {"x": x1})  # credit 1: it waits at the broker
        broker.p.send_signal(signal.SIGTERM)
        broker.wait_log("shutting down (SIGTERM or SIGINT)")
        assert get(base, "/v2/health/ready")[0] == 503  # (orchestrators stop sending clients)
        gate.release(1)
        with held.result(timeout=20) as r:  # through the old broker, which still runs
            np.testing.assert_array_equal(r["x"], x0)
        assert broker.p.wait(20) == 0, broker.stderr()
        assert "drained: exiting" in broker.stderr()
        assert gate.entered() == 1  # the queued one never went to the worker
        # A restart: the worker registers again, the client sends the queued call again.
        cluster.broker()
        gate.release(1)
        with queued.result(timeout=20) as r:
            np.testing.assert_array_equal(r["x"], x1)
        assert gate.entered() == 2 and c.broker_restarts >= 1


@contextlib.contextmanager
def _held_at_a_drain(cluster, gate, *broker_args: str):
    """A broker (``broker_args``), a gated worker answering through it, and one call held at
    the gate; yields (broker, client): the test signals the broker.  The gate opens after."""
    broker = cluster.broker(*broker_args)
    worker = cluster.worker("gate_model:copying", "--service", "gate", "--no-direct-reply", "--no-warmup",
                            env=gate.env, wait=False)
    gate.open()
    worker.wait_ready()
    with Client(cluster.frontend, timeout=30) as c:
        wait_service(c, "gate")
        h = c.infer_stream("gate", {"x": np.zeros(4, np.int32)})  # (kept: a handle dropped cancels its call)
        gate.wait_entered(1)
        try:
            yield broker, c
        finally:
            gate.release(1)
            h.close()


def test_a_second_sigterm_stops_a_draining_broker_at_once(cluster, gate):
    import signal

    with _held_at_a_drain(cluster, gate, "--log-level", "info") as (broker, _):
        broker.p.send_signal(signal.SIGTERM)
        broker.wait_log("shutting down (SIGTERM or SIGINT)")
        assert broker.p.poll() is None  # draining: the request is held at the worker
        broker.p.send_signal(signal.SIGTERM)
        assert broker.p.wait(10) == 0, broker.stderr()
        assert "drained" not in broker.stderr()


def test_a_drain_that_runs_out_exits_anyway_and_says_what_was_left(cluster, gate):
    import signal

    with _held_at_a_drain(cluster, gate, "--drain-timeout-s", "0.5") as (broker, _):
        broker.p.send_signal(signal.SIGTERM)
        assert broker.p.wait(10) == 0, broker.stderr()
        assert "1 request(s) still at workers after 0.5 s of drain: exiting anyway" in broker.stderr()
