"""End to end: CurveZMQ keys added and removed while the broker runs (docs/security.md,
"Adding and revoking keys while the broker runs"), against real broker, worker and client
processes on tcp loopback.

A key copied into an allow-list is served without a restart; a key removed stops being
served on the connection it already holds (its brokered calls, its MMI questions, and its
pinned calls, whose lease ends, all answered 403: `Forbidden`), while every other client is
served as before; an entry that fails its checks adds nothing, but removals beside it hold; a worker whose key is removed
is disconnected, told why, and exits 2, its service served by the others.

Every wait is bounded: the broker's log is read for each reload (`Proc.wait_log`), and a
removal is waited for by calling until the refusal comes, against a deadline.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from types import SimpleNamespace

import numpy as np
import pytest
import zmq.auth

from broker import security as S
from client_sdk import AsyncClient, Client, Forbidden

from .conftest import Proc, wait_service

pytestmark = pytest.mark.timeout(120)

LOOPBACK = "tcp://127.0.0.1:0"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    return {n: SimpleNamespace(pub=pub, sec=sec)
            for n in ("server", "a", "b", "c", "junk", "w1", "w2")
            for pub, sec in [S.make_keys(str(root), n)]}


@pytest.fixture
def broker(tmp_path, made):
    """A CURVE broker on tcp loopback whose allow-lists are this test's to change: clients
    {a}, workers {w1, w2}."""
    clients, workers = tmp_path / "clients", tmp_path / "workers"
    clients.mkdir()
    workers.mkdir()
    shutil.copy(made["a"].pub, clients)
    for w in ("w1", "w2"):
        shutil.copy(made[w].pub, workers)
    b = Proc(["-m", "broker", "--frontend", LOOPBACK, "--backend", LOOPBACK, "--heartbeat-interval", "0.2",
              "--curve-secret", made["server"].sec, "--client-keys", str(clients), "--worker-keys", str(workers)])
    try:
        b.wait_ready()
        yield SimpleNamespace(proc=b, frontend=b.field("frontend"), backend=b.field("backend"), clients=clients,
                              workers=workers)
    finally:
        b.close()


def _worker(broker, made, key: str, *extra: str) -> Proc:
    p = Proc(["-m", "gpu_worker", "--broker", broker.backend, "--model", "echo", "--heartbeat-interval", "0.2",
              "--out-capacity-mb", "16", "--server-key", made["server"].pub, "--worker-key", made[key].sec, *extra])
    p.wait_ready()
    return p


def _client(broker, made, key: str, **kw) -> Client:
    return Client(broker.frontend, server_key=made["server"].pub, client_key=made[key].sec, timeout=20, **kw)


def _echo(c: Client, service: str, x: np.ndarray) -> None:
    with c.infer(service, {"x": x}) as out:
        np.testing.assert_array_equal(out["x"], x)


def test_keys_added_and_removed_while_the_broker_runs(broker, made):
    x = np.arange(16, dtype=np.int64)
    w = _worker(broker, made, "w1", "--direct-tcp", "tcp://127.0.0.1:0")
    try:
        with _client(broker, made, "a", pin=True) as a:
            wait_service(a, "echo")
            deadline = time.monotonic() + 20
            while not a.pinned("echo"):  # a's calls go straight to the worker, on a lease
                assert time.monotonic() < deadline, "the client never pinned"
                _echo(a, "echo", x)
                if not a.pinned("echo"):
                    a.pump(0.05)

            # Added: b is served, no restart.
            shutil.copy(made["b"].pub, broker.clients)
            broker.proc.wait_log("2 key(s), 1 added, 0 removed")
            with _client(broker, made, "b") as b:
                _echo(b, "echo", x)

                # Removed: the connection a holds is served no more, on either path.
                os.unlink(broker.clients / "a.key")
                broker.proc.wait_log("1 key(s), 0 added, 1 removed")
                deadline = time.monotonic() + 20
                served = 0
                while True:
                    try:
                        _echo(a, "echo", x)
                    except Forbidden as e:
                        assert "removed from the broker's client allow-list" in str(e), str(e)
                        break
                    served += 1  # sent before the broker acted on the removal
                    assert time.monotonic() < deadline, "a removed key is still served"
                assert not a.pinned("echo")  # its lease ended
                # The broker's line names the key (the operator removed a key, not a routing id).
                a_key = zmq.auth.load_certificate(str(made["a"].pub))[0].decode()
                broker.proc.wait_log(f"key {a_key}: its CurveZMQ key was removed from the client allow-list")
                for _ in range(3):
                    with pytest.raises(Forbidden):
                        _echo(a, "echo", x)
                with pytest.raises(Forbidden):
                    a.mmi_service("echo")
                # A plain MDP request makes a connection of its own, whose handshake the
                # broker refuses: at once, not at its timeout with "raise `timeout`" (the
                # client audit), in both twins.
                t0 = time.monotonic()
                with pytest.raises(Forbidden, match="refused the handshake of this request's connection"):
                    a.request("echo", [b"opaque"], timeout=15)
                assert time.monotonic() - t0 < 10

                async def refused_async() -> None:
                    async with AsyncClient(broker.frontend, server_key=made["server"].pub,
                                           client_key=made["a"].sec, timeout=20) as aa:
                        with pytest.raises(Forbidden, match="refused the handshake"):
                            await aa.request("echo", [b"opaque"], timeout=15)

                t0 = time.monotonic()
                asyncio.run(refused_async())
                assert time.monotonic() - t0 < 10
                assert isinstance(Forbidden("x"), PermissionError)
                _echo(b, "echo", x)  # the others are served as before
                assert b.mmi_service("echo")

                # A list that fails its checks is not taken: b stays, a stays out.  (Its line
                # after the mark: a look that met a key half copied above said it too.)
                mark = broker.proc.logged
                shutil.copy(made["c"].pub, broker.clients)
                broker.proc.wait_log("2 key(s), 1 added, 0 removed", after=mark)
                with _client(broker, made, "c") as c:
                    _echo(c, "echo", x)
                    mark = broker.proc.logged
                    (broker.clients / "junk.key").write_text("not a certificate\n")
                    broker.proc.wait_log("cannot be taken", after=mark)
                    _echo(b, "echo", x)
                    with pytest.raises(Forbidden):
                        _echo(a, "echo", x)
                    # ...but its removals hold (they waited for the junk to go): c is refused.
                    os.unlink(broker.clients / "c.key")
                    broker.proc.wait_log("1 key(s), 0 added, 1 removed", after=mark)
                    deadline = time.monotonic() + 20
                    while True:
                        try:
                            _echo(c, "echo", x)
                        except Forbidden:
                            break
                        assert time.monotonic() < deadline, "a key removed beside a stray entry is still served"
                _echo(b, "echo", x)
                # Put back (the junk gone, a's key copied in again): a is served again.
                mark = broker.proc.logged
                os.unlink(broker.clients / "junk.key")
                shutil.copy(made["a"].pub, broker.clients)
                broker.proc.wait_log("2 key(s), 1 added, 0 removed", after=mark)
                _echo(a, "echo", x)
    finally:
        w.close()


def test_a_worker_whose_key_is_removed_is_disconnected_and_exits(broker, made):
    x = np.arange(8, dtype=np.float32)
    w1 = _worker(broker, made, "w1")
    w2 = _worker(broker, made, "w2")
    try:
        with _client(broker, made, "a") as a:
            wait_service(a, "echo")
            os.unlink(broker.workers / "w2.key")
            try:
                code = w2.p.wait(20)
            except Exception:
                raise AssertionError(f"the worker whose key was removed still runs: {w2.stderr()}") from None
            err = w2.stderr(None)
            assert code == 2 and "removed from the broker's worker allow-list" in err, (code, err[-2000:])
            for i in range(10):  # its service is served by the other
                _echo(a, "echo", x + i)
            assert w1.p.poll() is None
            broker.proc.wait_log("its CurveZMQ key was removed from the worker allow-list")
    finally:
        w2.close()
        w1.close()
