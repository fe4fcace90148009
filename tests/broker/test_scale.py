"""What the broker does stays cheap, and right, with many clients and services (found by the
scale hunt): its sweep of dead clients' reply-socket files looks at owners once seen alive by
pid alone until a full look is due, and a flood of worker disconnects sweeps once, not once
each (2000 clients made each sweep 22 ms of the broker's loop, and 200 heartbeats from an
unknown worker held a request up 4.5 s); a live service past the names' cap is described."""
from __future__ import annotations

import subprocess
import sys

import zmq

from broker import protocol as P
from broker import server as S
from shm.segment import self_identity


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    return p.pid


def test_owners_seen_alive_are_looked_at_by_pid_until_the_full_look(tmp_path, monkeypatch):
    pid, start = self_identity()
    live = [tmp_path / f"c-{pid}-{start}-{i:03x}.ipc" for i in range(50)]
    dead = tmp_path / f"c-{_dead_pid()}-12345-abc.ipc"
    for f in (*live, dead):
        f.write_bytes(b"")
    full = []
    real = S.process_alive
    monkeypatch.setattr(S, "process_alive", lambda *owner: full.append(owner) or real(*owner))
    sweep = S.ReplySocketSweep()
    assert sweep.sweep(str(tmp_path), now=0.0) == [dead.name]
    assert len(full) == 51
    full.clear()
    assert sweep.sweep(str(tmp_path), now=1.0) == [] and full == []  # by pid alone
    later = tmp_path / f"c-{_dead_pid()}-777-def.ipc"  # a new file: looked at in full
    later.write_bytes(b"")
    assert sweep.sweep(str(tmp_path), now=2.0) == [later.name] and len(full) == 1
    full.clear()
    assert sweep.sweep(str(tmp_path), now=2.0 + S.ReplySocketSweep.RECHECK_S) == [] and len(full) == 50
    assert all(f.exists() for f in live)


def test_an_owner_that_died_since_it_was_seen_alive_loses_its_file(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        from shm.segment import proc_starttime

        st = None
        while st is None:  # /proc has it once the child runs
            st = proc_starttime(p.pid)
        f = tmp_path / f"c-{p.pid}-{st}-abc.ipc"
        f.write_bytes(b"")
        sweep = S.ReplySocketSweep()
        assert sweep.sweep(str(tmp_path), now=0.0) == []
    finally:
        p.stdin.close()
        p.wait(30)
    assert sweep.sweep(str(tmp_path), now=1.0) == [f.name] and not f.exists()


def test_a_flood_of_worker_disconnects_asks_for_one_sweep(tmp_path, monkeypatch):
    cfg = S.BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc")
    with S.Broker(cfg) as b:
        swept = []
        monkeypatch.setattr(b, "_collect_shm", lambda: swept.append(1))
        b.send_to_worker = lambda frames: None
        for i in range(200):  # heartbeats from workers the broker does not know: each disconnected
            b.on_worker([zmq.Frame(b"W%d" % i), *(zmq.Frame(bytes(f)) for f in P.worker_heartbeat())])
        assert swept == [] and b._sweep_soon  # the loop sweeps once, soon


def test_a_live_service_past_the_names_cap_is_described_not_unknown(tmp_path, monkeypatch):
    # Found by the scale hunt: past 1024 services, /v2/models/{service} said 404 "unknown
    # service" for live ones (their names had no room in the list that bounds the labels).
    monkeypatch.setattr(S, "_MAX_SERVICES", 4)
    cfg = S.BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc")
    with S.Broker(cfg) as b:
        b.send_to_worker = lambda frames: None
        for i in range(6):
            ready = P.worker_ready(f"svc{i}", P.Ready(credit=1, transports=["inline"]))
            b.on_worker([zmq.Frame(b"W%d" % i), *(zmq.Frame(bytes(f)) for f in ready)])
        for i in range(6):
            info = b._http_answer("model", f"svc{i}")
            assert info and info["name"] == f"svc{i}" and info["ready"], (i, info)
            assert b._http_answer("model_ready", f"svc{i}") == "ready"
        assert b._http_answer("model", "nobody") == {}


def test_a_ready_looks_at_its_own_service_s_workers_not_at_every_worker(tmp_path):
    # Found by the scale hunt: each READY declaring inputs compared signatures by walking
    # every worker the broker knew, so a restart's storm of READYs was quadratic (8000
    # workers of as many services: 1.6 s of the loop, 0.2 ms each of the last READYs).
    cfg = S.BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc")

    def ready(i, service, dtype="float32"):
        r = P.Ready(credit=1, transports=["inline"], inputs={"x": (dtype, [None, 4])})
        return [zmq.Frame(b"W%d" % i), *(zmq.Frame(bytes(f)) for f in P.worker_ready(service, r))]

    class Looked(dict):
        n = 0

        def items(self):
            for kv in super().items():
                Looked.n += 1
                yield kv

        def get(self, key, default=None):
            Looked.n += 1
            return super().get(key, default)

    with S.Broker(cfg) as b:
        b.send_to_worker = lambda frames: None
        for i in range(300):
            b.on_worker(ready(i, f"other{i}"))
        b.on_worker(ready(1000, "svc"))
        b._worker_info = Looked(b._worker_info)
        Looked.n = 0
        b.on_worker(ready(1001, "svc", "int8"))  # unlike its service's live worker: said once
        assert Looked.n <= 4
        assert b._sig_warned and all(k[0] == "svc" for k in b._sig_warned)


def test_a_service_that_found_the_names_full_is_named_once_there_is_room(tmp_path, monkeypatch):
    # Found by the HTTP audit: a service whose READY found the names full stayed unnamed for
    # its worker's life (counted under _other; its readiness a 404 "unknown" once its worker
    # went, not a 503), since only a READY added names.  It is added once there is room.
    monkeypatch.setattr(S, "_MAX_SERVICES", 4)
    cfg = S.BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc")

    def frames(i, msg):
        return [zmq.Frame(b"W%d" % i), *(zmq.Frame(bytes(f)) for f in msg)]

    with S.Broker(cfg) as b:
        b.send_to_worker = lambda frames: None
        for i in range(4):
            b.on_worker(frames(i, P.worker_ready(f"svc{i}", P.Ready(credit=1, transports=["inline"]))))
        b.on_worker(frames(0, P.worker_disconnect()))
        b._prune_workers()  # svc0 has no worker from now on
        b.on_worker(frames(4, P.worker_ready("svc4", P.Ready(credit=1, transports=["inline"]))))
        assert "svc4" not in b._seen_services  # full, and svc0 not gone long enough to make room
        b._prune_workers()
        assert "svc4" not in b._seen_services
        b._seen_services.evict_after = 0.0  # (svc0 gone long enough)
        b._prune_workers()
        assert "svc4" in b._seen_services and "svc0" not in b._seen_services and not b._unlabelled
        b.on_worker(frames(4, P.worker_disconnect()))
        assert b._http_answer("model_ready", "svc4") == "unavailable"  # a 503, not "unknown"
