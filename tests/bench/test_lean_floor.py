"""bench.lean_floor: the lean MDP pair speaks our protocol well enough for the SDK client to
use its worker, and the whole measurement runs (a refactor of the protocol helpers must not
silently break it).  Numbers are the bench's business, not this test's."""
from __future__ import annotations

import numpy as np
import pytest

from bench import lean_floor

pytestmark = pytest.mark.timeout(120)


def test_every_path_is_measured_and_answers():
    res = lean_floor.measure(n=30, repeats=1)
    assert set(res["p50_us"]) == {"proxy", "lean", "lean->sdk-w", "sdk->lean-w", "proxy-sdk"}
    assert all(v > 0 for v in res["p50_us"].values())
    assert set(res["over_proxy"]) == {"lean", "lean->sdk-w", "sdk->lean-w", "proxy-sdk"}
    # CPU per request by process (Linux): every path, every process of it did some work
    assert set(res["cpu_us"]) == set(res["p50_us"])
    for per in res["cpu_us"].values():
        assert set(per) == {"client", "relay", "server", "total"}
        assert all(v > 0 for v in per.values())
        assert per["total"] >= max(per["client"], per["relay"], per["server"])


def test_cpu_ns_counts_this_process_threads_and_is_none_for_no_process():
    import os
    import threading

    before = lean_floor.cpu_ns(os.getpid())
    done = threading.Event()

    def spin():
        x = 0
        for i in range(200_000):
            x += i
        done.set()

    t = threading.Thread(target=spin)
    t.start()
    assert done.wait(30)
    after = lean_floor.cpu_ns(os.getpid())  # read while the spinning thread still exists
    t.join(30)
    assert after > before
    assert lean_floor.cpu_ns(2**22 + 12345) is None  # above pid_max's default: no such process


def test_the_lean_worker_echoes_the_sdk_client_bit_exactly():
    from bench.peers import Peer
    from client_sdk import Client

    class Lean(Peer):
        name = "lean-test"

        def start(self) -> None:
            self.endpoint, back = self.ipc("f"), self.ipc("b")
            self.spawn(self.python_module("bench.echo_servers", "proxy", "--front", self.endpoint, "--back", back))
            self.spawn(self.python_module("bench.lean_floor", "worker", "--connect", back))

    with Lean() as peer, Client(peer.endpoint, timeout=20, transport="inline") as c:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        with c.infer("echo", {"x": x}) as r:
            assert r["x"].dtype == x.dtype and np.array_equal(r["x"], x)
        lean = lean_floor.LeanClient(peer.endpoint)
        try:
            assert np.array_equal(lean.call(), np.zeros(16, np.uint8))
        finally:
            lean.close()
