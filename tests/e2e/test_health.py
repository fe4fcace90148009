"""Health probes that flip with the real processes: the broker's readiness while its launcher
drains (`python -m broker --config FILE --http 127.0.0.1:0`, a request held by
tests/e2e/gate_model.py's `held` model, so the drain lasts until the test lets it end), and a
worker's `--health-port` readiness before and after its broker comes up.  Every wait polls
a condition or reads a line, with a timeout."""
from __future__ import annotations

import json
import signal
import textwrap

import numpy as np
import pytest

from client_sdk import Client

from .conftest import Proc, listening_port, wait_service
from .test_metrics import WAIT, get, until

pytestmark = pytest.mark.timeout(60)


def test_the_broker_is_not_ready_while_it_drains(tmp_path, gate):
    frontend = f"ipc://{tmp_path}/fe.ipc"
    path = tmp_path / "deploy.toml"
    path.write_text(f'frontend = "{frontend}"\nbackend = "ipc://{tmp_path}/be.ipc"\n'
                    "[scheduler]\nheartbeat_interval = 0.2\n" + textwrap.dedent("""
                        [[pool]]
                        model = "gate_model:held"
                        service = "held"
                        max_batch = 1
                        credit = 1
                    """))
    la = Proc(["-m", "broker", "--config", str(path), "--http", "127.0.0.1:0", "--log-level", "INFO"],
              env={**gate.env, "SLEEPY_LOG": str(tmp_path / "held.log")})
    try:
        la.wait_ready()
        gate.open()  # the worker opened the FIFO as it loaded: at once
        base = "http://" + la.field("http")
        assert get(base, "/v2/health/ready")[0] == 200
        assert get(base, "/v2/models/held/ready")[0] == 200
        x = np.array([-1.0])  # held until the gate releases it
        with Client(frontend, timeout=WAIT) as c:
            wait_service(c, "held")
            call = c.infer_stream("held", {"x": x})
            until(lambda: json.loads(get(base, "/v2/models/held")[1])["in_flight"] == 1, "the request at the worker")
            la.p.send_signal(signal.SIGTERM)
            la.wait_log("shutting down")  # logged after the broker started refusing new requests
            # Draining: alive, but neither the broker nor its service takes new work.
            assert get(base, "/v2/health/live")[0] == 200
            assert get(base, "/v2/health/ready")[0] == 503
            assert get(base, "/v2/models/held/ready")[0] == 503
            held = json.loads(get(base, "/v2/models/held")[1])
            assert held["in_flight"] == 1  # still held
            assert held["ready"] is False  # as its /ready says (it said true: the HTTP audit)
            gate.release()
            r = call.result(timeout=WAIT)
            np.testing.assert_array_equal(r["x"], x)
            r.release()
        assert la.p.wait(WAIT) == 0, la.stderr()
    finally:
        la.close()


def test_the_broker_is_not_ready_until_every_pool_is(tmp_path, gate):
    # Found by the docs hunt: readiness was 200 once the fastest pool registered, while the
    # others still loaded (README waits on it before sending): requests let in met 503s.
    path = tmp_path / "deploy.toml"
    path.write_text(f'frontend = "ipc://{tmp_path}/fe.ipc"\nbackend = "ipc://{tmp_path}/be.ipc"\n'
                    "[scheduler]\nheartbeat_interval = 0.2\n" + textwrap.dedent("""
                        [[pool]]
                        model = "echo"
                        [[pool]]
                        model = "gate_model:factory"
                        service = "gate"
                    """))
    # Port 0: the kernel's pick, read from its sockets (READY, which names it, comes only
    # once every pool is ready)
    la = Proc(["-m", "broker", "--config", str(path), "--http", "127.0.0.1:0"], env=gate.env)
    try:
        base = f"http://127.0.0.1:{listening_port(la.p.pid)}"
        until(lambda: _status(base, "/v2/models/echo/ready") == 200, "the echo pool registered")
        assert get(base, "/v2/health/ready")[0] == 503  # the gate pool still loads (its FIFO)
        gate.open()  # the gate worker's load ends
        la.wait_ready()
        assert get(base, "/v2/health/ready")[0] == 200
    finally:
        la.close()


def _status(base: str, path: str) -> int | None:
    try:
        return get(base, path)[0]
    except OSError:  # not listening yet
        return None


def test_a_workers_readiness_waits_for_its_broker(cluster):
    """Ready (gpu_worker.health) means the broker has it registered: not before a broker is
    there at all, and once one comes up, without restarting the worker."""
    # No broker yet: the worker announces READY after its WELCOME wait, unregistered.
    w = cluster.worker("echo", "--health-port", "127.0.0.1:0")
    base = "http://" + w.field("health")
    assert get(base, "/v2/health/live")[0] == 200
    status, body = get(base, "/v2/health/ready")
    before = (status, json.loads(body))
    cluster.broker()
    until(lambda: get(base, "/v2/health/ready")[0] == 200, "the worker registered")
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "echo")
        with c.infer("echo", {"x": np.arange(4)}) as r:
            np.testing.assert_array_equal(r["x"], np.arange(4))
    assert w.terminate() == 0  # drains: DISCONNECT to a live broker
    # Checked last, so that what follows registration is checked whatever this says.
    assert before == (503, {"ready": False}), "ready with no broker running"


def test_an_idle_worker_starts_its_drain_when_the_signal_comes(cluster):
    """SIGTERM to a worker with nothing to do: its readiness turns 503 and it exits at once,
    not at its next wake-up a heartbeat interval later (10 s here), during which it would
    still take work an orchestrator had started to move elsewhere."""
    import time

    cluster.broker("--heartbeat-interval", "10")  # the workers adopt it (WELCOME)
    w = cluster.worker("echo", "--health-port", "127.0.0.1:0", "--heartbeat-interval", "10")
    base = "http://" + w.field("health")
    until(lambda: get(base, "/v2/health/ready")[0] == 200, "the worker registered")
    t0 = time.monotonic()
    w.p.send_signal(signal.SIGTERM)
    assert w.p.wait(30) == 0
    assert time.monotonic() - t0 < 5.0, "the worker noticed the signal only at its next wake-up"


def test_a_worker_pointed_at_the_brokers_frontend_is_not_ready(cluster):
    # The wrong endpoint, connected: no WELCOME comes, so READY is printed after the wait
    # (the plain-MDP fallback; a relay's workers need it), and the probe then said 200 for
    # good.  A plain MDP broker heartbeats its workers; a frontend says nothing a worker can
    # read: the probe says 503, and both sides name the likely mistake.
    broker = cluster.broker()
    w = Proc(["-m", "gpu_worker", "--broker", cluster.frontend, "--model", "echo", "--heartbeat-interval", "0.2",
              "--health-port", "127.0.0.1:0"])
    cluster.procs.append(w)
    w.wait_ready()
    base = "http://" + w.field("health")
    w.wait_log("is it the broker's backend endpoint (not its frontend)?")
    broker.wait_log("connect to the backend")
    for _ in range(5):
        assert get(base, "/v2/health/ready") == (503, b'{"ready": false}')


def _takes_sigterm(pid: int) -> list[str]:
    """The threads of `pid` that do not block SIGTERM (/proc/PID/task/*/status, SigBlk); a
    thread that ended between the listing and its read (the health probe's request thread,
    a fresh clone's run) takes nothing."""
    import os

    out = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                blocked = next(line for line in f if line.startswith("SigBlk:")).split()[1]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
        if not int(blocked, 16) & (1 << (signal.SIGTERM - 1)):
            out.append(tid)
    return out


def test_only_a_workers_main_thread_takes_its_sigterm(cluster):
    # The kernel hands a process's SIGTERM to any thread that does not block it, and the
    # interpreter runs the handler on the main thread only when that thread comes back to
    # Python: one that landed on a helper thread (the heartbeat, compute, health, log-writer
    # or BLAS threads, pyzmq's) while the main thread waited in a model's read during a long
    # batch went unseen until the batch ended (the test above failed about one run in three).
    cluster.broker()
    w = cluster.worker("echo", "--health-port", "127.0.0.1:0")
    base = "http://" + w.field("health")
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "echo")
        with c.infer("echo", {"x": np.zeros(1 << 17, np.float32)}) as r:  # a large reply, a batch
            assert r["x"].shape == (1 << 17,)
    assert get(base, "/v2/health/ready")[0] == 200  # a request thread of its probe too
    assert _takes_sigterm(w.p.pid) == [str(w.p.pid)]


def test_a_draining_worker_is_not_counted_live_while_it_finishes(cluster, tmp_path, gate):
    """SIGTERM to a service's only worker while it runs a long request: it says STOPPING, and
    at once the broker's readiness for the service is 503, `mmi.service` 404, and a new
    request for it waits the service grace and fails ServiceUnavailable, instead of being
    handed to the draining worker, held until the drain ends and then failed with "presumed
    dead after silence" (the observability hunt).  The request it holds still completes."""
    from client_sdk import ServiceUnavailable

    broker = cluster.broker("--http", "127.0.0.1:0", "--service-grace", "0.3")
    base = "http://" + broker.field("http")
    runs = tmp_path / "l"
    w = cluster.worker("gate_model:held", "--max-batch", "1", env={**gate.env, "SLEEPY_LOG": str(runs)})
    gate.open()
    x = np.array([-1.0])  # held until the gate releases it
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "held")
        assert get(base, "/v2/models/held/ready")[0] == 200
        call = c.infer_stream("held", {"x": x})
        # Running in the model (its line in $SLEEPY_LOG), not only dispatched (the broker's
        # in_flight): a worker that reads it after its SIGTERM sends it back (503).
        until(lambda: runs.exists() and runs.read_text().count("\n") == 1, "the request running at the worker")
        w.p.send_signal(signal.SIGTERM)
        until(lambda: get(base, "/v2/models/held/ready")[0] == 503, "the service unready while its worker drains")
        assert not c.mmi_service("held")
        with pytest.raises(ServiceUnavailable) as e:
            c.infer("held", {"x": np.zeros(1)}, timeout=WAIT)
        assert "no live worker" in str(e.value), e.value
        assert w.p.poll() is None  # still draining: the held request is its
        gate.release()
        r = call.result(timeout=WAIT)
        np.testing.assert_array_equal(r["x"], x)
        r.release()
    assert w.p.wait(WAIT) == 0


def test_a_worker_is_not_ready_once_signalled_during_a_batch(cluster, gate, tmp_path):
    """The metrics hunt: SIGTERM during a long batch left the worker's own readiness 200
    until the batch ended (its loop sets `stop` after it), while the broker, told STOPPING
    by the heartbeat thread, had taken it out at once."""
    cluster.broker()
    runs = tmp_path / "runs.log"
    w = cluster.worker("gate_model:held", "--health-port", "127.0.0.1:0", env={"SLEEPY_LOG": str(runs), **gate.env})
    gate.open()
    base = "http://" + w.field("health")
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "held")
        until(lambda: get(base, "/v2/health/ready")[0] == 200, "the worker registered")
        h = c.infer_stream("held", {"x": np.array([-1.0])})  # held until released
        until(lambda: runs.exists() and runs.read_text().count("\n") == 1, "the held request running")
        w.p.send_signal(signal.SIGTERM)
        until(lambda: get(base, "/v2/health/ready")[0] == 503, "not ready while it drains")
        assert get(base, "/v2/health/live")[0] == 200
        gate.release(1)
        h.result(timeout=WAIT).release()  # the batch it held still answers
    assert w.p.wait(WAIT) == 0


def test_a_request_line_whose_url_cannot_be_parsed_is_a_400_on_both_ports(cluster):
    # Found by the HTTP audit: "GET http://[::1 HTTP/1.0" made urlsplit raise: no answer at
    # all, and an ERROR with a traceback in the broker's (or the worker's) log.
    import socket

    broker = cluster.broker("--http", "127.0.0.1:0")
    w = cluster.worker("echo", "--health-port", "127.0.0.1:0")
    for proc, field in ((broker, "http"), (w, "health")):
        host, port = proc.field(field).rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=WAIT) as c:
            c.sendall(b"GET http://[::1 HTTP/1.0\r\n\r\n")
            got = b""
            while chunk := c.recv(4096):
                got += chunk
        assert got.startswith(b"HTTP/1.0 400"), got
    assert "Traceback" not in broker.stderr(tail=None) and "Traceback" not in w.stderr(tail=None)


def test_a_worker_is_not_ready_once_its_brokers_connection_closes(cluster):
    """The SLO audit: a broker SIGKILLed (or exited) left its workers' probes at 200 for
    their liveness window (3 s at the defaults; 15 s here), though each worker's monitor had
    seen its connection close at once."""
    broker = cluster.broker("--heartbeat-interval", "5")  # (the last flag wins: a 15 s window)
    w = cluster.worker("echo", "--health-port", "127.0.0.1:0")
    base = "http://" + w.field("health")
    until(lambda: get(base, "/v2/health/ready")[0] == 200, "the worker registered")
    broker.kill()
    until(lambda: get(base, "/v2/health/ready")[0] == 503, "not ready once its broker is gone", timeout=5)
    assert get(base, "/v2/health/live")[0] == 200
    cluster.broker("--heartbeat-interval", "5")  # a new one: registered again
    until(lambda: get(base, "/v2/health/ready")[0] == 200, "registered with the new broker")
