"""A worker's READY means registered (issue 14 item 6): `python -m gpu_worker` prints its
READY line on the broker's WELCOME, so a client started at once, with no MMI polling, is
served.  In process: the ready callback waits for WELCOME, runs once, and falls back to a
bounded wait for a broker that never sends WELCOME."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from broker import protocol as P
from client_sdk import Client
from gpu_worker.worker import READY_FALLBACK_INTERVALS, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(60)


def _echo_once(c: Client, i: int) -> None:
    x = np.full(64, i % 251, np.uint8)
    with c.infer("echo", {"x": x}, timeout=10) as r:
        np.testing.assert_array_equal(r["x"], x)


def test_a_client_started_on_ready_is_served_at_once(cluster):
    """No wait_service: the READY line alone says the broker has the worker.  Repeated over
    fresh workers, so a READY printed before registration would show as NOT_LOCAL or
    ServiceUnavailable: the broker runs with no service grace (a request for a service
    without a registered worker fails at once instead of waiting for one to register), and
    the client does not fall back to inline (which would resend a NOT_LOCAL)."""
    cluster.broker("--service-grace", "0")
    for i in range(3):
        w = cluster.worker("echo")  # returns on the READY line
        with Client(cluster.frontend, transport="shm", timeout=10, fallback_inline=False) as c:
            _echo_once(c, i)
        assert w.terminate() == 0


# ---------------------------------------------------------------- in process, a fake broker


class _FakeBroker:
    """A ROUTER on the worker's broker endpoint: reads its READYs, answers WELCOME on demand."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(endpoint)

    def ready_identity(self, timeout: float = 5.0) -> bytes:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                if frames[2:3] == [P.W_READY]:
                    return frames[0]
        raise TimeoutError("no READY from the worker")

    def heartbeat(self, ident: bytes) -> None:
        self.sock.send_multipart([ident, P.MDPW, P.W_HEARTBEAT])

    def welcome(self, ident: bytes, instance: bytes = b"\x01" * 8) -> None:
        self.sock.send_multipart(P.to_worker_welcome(
            ident, P.Welcome(instance=instance, heartbeat_interval=1.0, heartbeat_liveness=3)))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def served(tmp_path):
    """(worker, fake broker, ready calls): a worker serving in a thread against the fake."""
    endpoint = f"ipc://{tmp_path}/be.ipc"
    broker = _FakeBroker(endpoint)
    calls: list[float] = []
    box: dict = {}

    def start(heartbeat_interval: float):
        w = Worker(WorkerConfig(broker=endpoint, model="echo", warmup=False,
                                heartbeat_interval=heartbeat_interval))
        t = threading.Thread(target=w.serve, kwargs={"ready_cb": lambda: calls.append(time.monotonic())},
                             daemon=True)
        t0 = time.monotonic()
        t.start()
        box.update(w=w, t=t)
        return w, t0

    try:
        yield start, broker, calls
    finally:
        try:
            if "w" in box:
                box["w"].stop.set()
                box["t"].join(10)
                # The worker's sockets are its serving thread's (zmq sockets are not
                # thread-safe): closed here only once that thread ended.
                assert not box["t"].is_alive(), "the worker's serve() did not return within 10 s of its stop"
                box["w"].close()
        finally:
            broker.close()


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_ready_waits_for_welcome_and_runs_once(served):
    start, broker, calls = served
    start(heartbeat_interval=1.0)  # fallback after 2 s: far beyond what this test waits
    ident = broker.ready_identity()
    time.sleep(0.2)
    assert calls == [], "READY announced before the broker's WELCOME"
    broker.welcome(ident)
    _wait(lambda: calls)
    # A second WELCOME (a broker restart, a new instance) registers again, silently.
    broker.welcome(ident, instance=b"\x02" * 8)
    time.sleep(0.2)
    assert len(calls) == 1


def test_ready_falls_back_after_a_bounded_wait_without_welcome(served):
    start, broker, calls = served
    interval = 0.1
    _, t0 = start(heartbeat_interval=interval)
    broker.heartbeat(broker.ready_identity())
    _wait(lambda: calls)  # a plain MDP broker: no WELCOME ever, a heartbeat
    waited = calls[0] - t0
    assert READY_FALLBACK_INTERVALS * interval * 0.9 <= waited < READY_FALLBACK_INTERVALS * interval + 1.0, waited
    time.sleep(3 * interval)
    assert len(calls) == 1


def test_ready_without_a_word_from_the_broker_says_what_may_be_wrong(served, caplog):
    # A worker pointed at something that answers nothing (a broker's frontend, another
    # program; or a relay such as zmq.proxy, which speaks only when a request comes):
    # READY after the wait all the same, with the likely mistake said.
    start, broker, calls = served
    interval = 0.05
    start(heartbeat_interval=interval)
    broker.ready_identity()
    _wait(lambda: calls)
    assert "nothing heard from" in caplog.text and "not its frontend" in caplog.text
