"""The floor peers really start, echo bit-exactly (sync and async, concurrently) and stop
without leaving a process behind (the suite's autouse fixture checks the latter)."""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from bench.peers import PEERS, Peer, PeerStartError, availability, make_peer

FLOORS = ["direct", "proxy", "grpc"]


@pytest.fixture(scope="module")
def frame() -> np.ndarray:
    return np.random.default_rng(5).integers(0, 256, size=(1080, 1920, 3), dtype=np.uint8)


@pytest.mark.parametrize("name", FLOORS)
async def test_floor_peer_echoes_bit_exactly_and_stops(name, frame):
    peer = make_peer(name)
    assert peer.available() == (True, "")
    with peer:
        pids = [p.pid for p in peer._procs]
        assert pids and all(os.path.exists(f"/proc/{pid}") for pid in pids)

        sync = peer.client()
        try:
            r = sync.request_sync(frame)
            assert bytes(r["reply"]) == frame.tobytes()
            assert bytes(sync.request_sync(b"\x00\x01tiny")["reply"]) == b"\x00\x01tiny"
        finally:
            sync.close()

        client = peer.client()
        try:
            # Concurrent requests of different sizes on one client must each get their own
            # reply back (id matching for zmq, FIFO order for gRPC).
            payloads = [bytes([i]) * (1 + 1000 * i) for i in range(16)] + [frame]
            replies = await asyncio.gather(*(client.request(p) for p in payloads))
            for p, r in zip(payloads, replies):
                want = p.tobytes() if isinstance(p, np.ndarray) else p
                assert bytes(r["reply"]) == want
        finally:
            await client.aclose()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)
    assert peer._tmpdir is None


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def test_stop_is_idempotent_and_reaps_on_start_failure():
    class Broken(Peer):
        name = "broken"

        def start(self):
            self.spawn(self.python_module("bench.echo_servers", "zmq-echo", "--bind", self.ipc("a")))
            # Second server exits before READY: start must raise, stop must reap the first.
            self.spawn(["python3", "-c", "import sys; sys.exit(3)"])

    p = Broken()
    with pytest.raises(PeerStartError, match="status 3"):
        with p:
            pass
    assert p._procs == []
    p.stop()  # again: harmless


def test_silent_server_times_out():
    class Silent(Peer):
        name = "silent"

        def start(self):
            self.spawn(["python3", "-c", "import time; time.sleep(30)"], ready_timeout=0.3)

    with pytest.raises(PeerStartError, match="no READY"):
        with Silent():
            pass


def test_optional_peers_report_a_reason_when_missing():
    status = availability(["pytriton", "rayserve", "no-such-peer"])
    for name in ("pytriton", "rayserve"):
        ok, why = status[name]
        if not ok:
            assert "not installed" in why or "not importable" in why
    assert status["no-such-peer"][0] is False
    assert "unknown peer" in status["no-such-peer"][1]


def test_registry_holds_the_floors_in_order():
    assert list(PEERS)[:3] == FLOORS
    for cls in PEERS.values():
        assert cls.name and cls.description


def test_start_ready_reaps_a_process_that_never_said_ready():
    """`start_ready`: a process that exits, stays silent, or whose wait a Ctrl-C ends is
    killed and reaped before the exception goes on (the suite's fixture checks that no
    process is left)."""
    from bench.peers import start_ready
    from tests.alarms import alarm

    with pytest.raises(PeerStartError, match="status 3"):
        start_ready(["-c", "import sys; sys.exit(3)"])
    with pytest.raises(PeerStartError, match="no READY"):
        start_ready(["-c", "import time; time.sleep(30)"], timeout=0.3)

    def interrupt(signum, frame):
        # In the wait for READY, not in Popen (which `signals_held` guards only against
        # SIGINT and SIGTERM, not this SIGALRM): a slow start rings again.
        while frame is not None and frame.f_code.co_name != "wait_ready":
            frame = frame.f_back
        if frame is not None:
            raise KeyboardInterrupt

    with alarm(interrupt, 0.3, interval=0.05), pytest.raises(KeyboardInterrupt):
        start_ready(["-c", "import time; time.sleep(30)"], timeout=30)


def test_a_started_process_still_running_at_exit_is_stopped_then(monkeypatch):
    """What `start_ready` started and the caller never stopped (a Ctrl-C between its return
    and the caller's keeping it) is stopped at interpreter exit."""
    import weakref

    from bench import peers

    p = peers.start_ready(["-c", "print('READY', flush=True); import time; time.sleep(30)"])
    try:
        assert p.poll() is None
        assert p in peers._STARTED
        # This test's process alone (what other tests of this worker started is theirs).
        monkeypatch.setattr(peers, "_STARTED", weakref.WeakSet([p]))
        peers._stop_started()  # what the interpreter's exit runs
        assert p.returncode is not None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        p.stdout.close()


def test_a_sigterm_held_while_a_harness_has_no_handler_of_its_own_exits_through_finally(tmp_path):
    """A SIGTERM held by `signals_held` in a process whose SIGTERM is at its default (a
    harness run without `sigterm_exits`) was raised again there and ended the process at
    once, past the `finally` and atexit that stop what it started; it is SystemExit(143)."""
    import subprocess
    import sys

    script = tmp_path / "held.py"
    script.write_text(
        "import os, signal, sys\n"
        "from bench.peers import signals_held\n"
        "try:\n"
        "    with signals_held():\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    print('not reached', flush=True)\n"
        "finally:\n"
        "    print('finally ran', flush=True)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 143, r
    assert r.stdout == "finally ran\n", r
