"""The broker's allow-lists read again while it runs (broker/security.py, docs/security.md
"Adding and revoking keys while the broker runs"): what a reload takes, what it refuses,
and what it tells the broker's loop.  Each look is called by hand (`ServerCurve.reload`);
the watcher thread that calls it once a second is the e2e tests' (test_key_reload.py)."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import zmq

from broker import security as S


def _z85(public_cert) -> bytes:
    return zmq.auth.load_certificate(str(public_cert))[0]


@pytest.fixture
def setup(tmp_path):
    """Keys a, b, c and a client allow-list holding a; a ServerCurve on it (no watcher)."""
    made = {n: S.make_keys(str(tmp_path / "keys"), n)[0] for n in ("server", "a", "b", "c")}
    clients = tmp_path / "clients"
    clients.mkdir()
    shutil.copy(made["a"], clients)
    cfg = S.SecurityConfig(curve_secret=str(tmp_path / "keys" / "server.key_secret"), client_keys=str(clients))
    plan = S.plan(cfg, "tcp://127.0.0.1:0", "ipc:///nowhere/backend.ipc")
    ctx = zmq.Context()
    curve = S.ServerCurve(ctx, plan, reload_period=0)
    curve.start()
    try:
        yield curve, clients, made
    finally:
        curve.stop()
        ctx.term()


def test_a_key_copied_in_is_taken_and_one_removed_is_reported(setup):
    curve, clients, made = setup
    a, b = _z85(made["a"]), _z85(made["b"])
    assert curve.allowed("frontend", a) and not curve.allowed("frontend", b)
    curve.reload()  # nothing changed: nothing to do
    assert not curve.removals and not curve.revoked
    shutil.copy(made["b"], clients)
    curve.reload()
    assert curve.allowed("frontend", b.decode()) and curve.allowed("frontend", a)  # the User-Id is a str
    assert not curve.removals and not curve.revoked  # an addition revokes nothing
    os.unlink(clients / "a.key")
    curve.reload()
    assert not curve.allowed("frontend", a) and curve.allowed("frontend", b)
    assert list(curve.removals) == [("frontend", frozenset({a}))] and curve.revoked
    assert curve.allowed("backend", a)  # a role without a list (an ipc backend) takes anyone


def test_a_list_that_fails_its_checks_is_not_taken_and_said_once(setup, caplog):
    curve, clients, made = setup
    a, b = _z85(made["a"]), _z85(made["b"])
    caplog.set_level(logging.ERROR, logger="broker")
    # A certificate copied half-way (or not one at all): the previous list stays in force.
    (clients / "b.key").write_text("metadata\ncurve\n    public-key = \"trunc")
    curve.reload()
    curve.reload()
    errors = [r for r in caplog.records if "cannot be taken" in r.getMessage()]
    assert len(errors) == 1, caplog.text
    assert "b.key" in errors[0].getMessage() and "1 key(s)" in errors[0].getMessage()
    assert curve.allowed("frontend", a) and not curve.allowed("frontend", b)
    shutil.copy(made["b"], clients / "b.key")  # the copy finished
    curve.reload()
    assert curve.allowed("frontend", a) and curve.allowed("frontend", b)
    # Emptied (every key moved out at once) or gone: never "refuse everyone".
    for f in os.listdir(clients):
        os.unlink(clients / f)
    curve.reload()
    assert curve.allowed("frontend", a) and curve.allowed("frontend", b) and not curve.removals
    os.rmdir(clients)
    curve.reload()
    assert curve.allowed("frontend", a) and not curve.removals
    assert len([r for r in caplog.records if "cannot be taken" in r.getMessage()]) == 3


def test_a_removal_holds_while_another_entry_fails_its_checks(setup, caplog):
    """Found by the security audit: a reload was all or nothing, so a key removed while any
    other entry did not read (a stray README.key, a half-copied file) stayed in force, new
    connections included, for as long as that entry sat there; and a rotation beside one
    (a new key in, the old one out) kept the old key (found by review).  The entries that
    read are the list; one that does not adds nothing and keeps the key it held."""
    curve, clients, made = setup
    a, b, c = _z85(made["a"]), _z85(made["b"]), _z85(made["c"])
    for n in ("b", "c"):
        shutil.copy(made[n], clients)
    curve.reload()
    assert all(curve.allowed("frontend", k) for k in (a, b, c))
    caplog.set_level(logging.WARNING, logger="broker")
    (clients / "junk.key").write_text("garbage\n")
    os.unlink(clients / "a.key")
    curve.reload()
    assert not curve.allowed("frontend", a) and curve.allowed("frontend", b) and curve.allowed("frontend", c)
    assert list(curve.removals) == [("frontend", frozenset({a}))] and curve.revoked
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "junk.key" in errors[0] and "1 of its entries cannot be taken" in errors[0], errors
    assert "2 key(s), 0 added, 1 removed" in caplog.text
    curve.reload()  # the same state: said once
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1
    # c.key half rewritten (not a removal: kept), b.key rotated to a's key (b leaves, a is
    # back), a2.key copied in.
    (clients / "c.key").write_text("metadata\ncurve\n    public-key = \"trunc")
    shutil.copy(made["a"], clients / "b.key")
    shutil.copy(made["a"], clients / "a2.key")
    curve.reload()
    assert not curve.allowed("frontend", b) and curve.allowed("frontend", c) and curve.allowed("frontend", a)
    assert list(curve.removals)[-1] == ("frontend", frozenset({b}))
    os.unlink(clients / "junk.key")  # the stray entry gone, c.key whole again
    shutil.copy(made["c"], clients / "c.key")
    curve.reload()
    assert curve.allowed("frontend", a) and curve.allowed("frontend", c) and not curve.allowed("frontend", b)
    # No entry that reads left beside a stray one: the previous list stays (an emptied list).
    for n in ("a2.key", "b.key", "c.key"):
        os.unlink(clients / n)
    (clients / "junk.key").write_text("garbage\n")
    curve.reload()
    assert curve.allowed("frontend", a) and curve.allowed("frontend", c)


def test_a_kubernetes_secret_volume_swap_is_seen(tmp_path):
    """A Secret volume: each file is a link through ``..data``, itself a link to a dated
    directory that the kubelet replaces whole (a new directory, the link renamed over):
    the same names, new files behind them."""
    made = {n: S.make_keys(str(tmp_path / "keys"), n)[0] for n in ("server", "a", "b")}
    vol = tmp_path / "vol"
    (vol / "..2026_12_06_1").mkdir(parents=True)
    shutil.copy(made["a"], vol / "..2026_12_06_1" / "client.key")
    os.symlink("..2026_12_06_1", vol / "..data")
    os.symlink("..data/client.key", vol / "client.key")
    cfg = S.SecurityConfig(curve_secret=str(tmp_path / "keys" / "server.key_secret"), client_keys=str(vol))
    ctx = zmq.Context()
    curve = S.ServerCurve(ctx, S.plan(cfg, "tcp://127.0.0.1:0", "ipc:///nowhere/b.ipc"), reload_period=0)
    curve.start()
    try:
        a, b = _z85(made["a"]), _z85(made["b"])
        assert curve.allowed("frontend", a)
        (vol / "..2026_12_06_2").mkdir()
        shutil.copy(made["b"], vol / "..2026_12_06_2" / "client.key")  # the same name, another key
        os.symlink("..2026_12_06_2", vol / "..data_tmp")
        os.rename(vol / "..data_tmp", vol / "..data")
        curve.reload()
        assert curve.allowed("frontend", b) and not curve.allowed("frontend", a)
        assert list(curve.removals) == [("frontend", frozenset({a}))]
    finally:
        curve.stop()
        ctx.term()


def test_a_key_rewritten_in_place_is_seen(setup):
    curve, clients, made = setup
    a, c = _z85(made["a"]), _z85(made["c"])
    st = os.stat(clients / "a.key")
    with open(clients / "a.key", "wb") as f:  # the same inode and size: an editor that writes in place
        f.write(open(made["c"], "rb").read())
    assert os.stat(clients / "a.key").st_ino == st.st_ino
    os.utime(clients / "a.key", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a later write
    curve.reload()
    assert curve.allowed("frontend", c) and not curve.allowed("frontend", a)


def test_the_state_names_each_key_file(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "x.key").write_text("x")
    (d / "x.key_secret").write_text("secret")  # not a public certificate: not looked at
    (d / "notes.txt").write_text("n")
    os.symlink("gone.key", d / "dangling.key")
    state = S.allow_list_state(str(d))
    assert [e[0] for e in state] == ["dangling.key", "x.key"]
    assert state[0][1] == "error"  # a dangling link is a fault the reload will name
    assert S.allow_list_state(str(tmp_path / "missing"))[0][0] == "error"


_HOSTILE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # a read that never ends fails here, not the host
from broker import security as S
try:
    S.load_allow_list(sys.argv[1], "client")
except S.SecurityError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_an_entry_that_is_no_file_is_refused_without_reading_it(tmp_path, kind):
    """A FIFO named x.key, or a link to /dev/zero: the watcher's (or the start's) read of it
    blocked for good (a FIFO: the watcher hung, the broker's close waited 10 s for it) or read
    until memory ran out (/dev/zero, again at each look).  Now a clear refusal, at once."""
    made = S.make_keys(str(tmp_path / "keys"), "a")[0]
    d = tmp_path / "clients"
    d.mkdir()
    shutil.copy(made, d)
    if kind == "fifo":
        os.mkfifo(d / "x.key")
    else:
        os.symlink("/dev/zero", d / "x.key")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        p = subprocess.run([sys.executable, "-c", _HOSTILE, str(d)], capture_output=True, text=True, timeout=20,
                           env={**os.environ, "PYTHONPATH": root})
    except subprocess.TimeoutExpired:
        raise AssertionError(f"reading the allow-list with {kind} in it did not end within 20 s") from None
    assert p.returncode == 0 and "REFUSED" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])
    assert "x.key" in p.stdout and "not a regular file" in p.stdout, p.stdout


def test_a_worker_key_removed_adds_nothing_to_an_ipc_clients_requests(tmp_path, monkeypatch):
    """An ipc frontend with a CurveZMQ tcp backend (workers on other hosts): a worker's key
    removed once made every ipc client REQUEST from then on ask its frame for a ZAP
    User-Id, which an ipc connection has not (an exception raised and caught, a few us of
    the hot path, for good).  Only a client key removed makes client messages looked up."""
    from broker import protocol as P
    from broker.server import Broker, BrokerConfig

    made = {n: S.make_keys(str(tmp_path / "keys"), n)[0] for n in ("server", "w1", "w2")}
    workers = tmp_path / "workers"
    workers.mkdir()
    for w in ("w1", "w2"):
        shutil.copy(made[w], workers)
    cfg = BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend="tcp://127.0.0.1:0",
                       security=S.SecurityConfig(curve_secret=str(tmp_path / "keys" / "server.key_secret"),
                                                 worker_keys=str(workers)))
    ctx = zmq.Context()
    b = Broker(cfg, ctx=ctx)
    c = ctx.socket(zmq.DEALER)
    c.linger = 0
    try:
        os.unlink(workers / "w2.key")
        deadline = time.monotonic() + 10
        while not b._curve.removals:  # the watcher's look (once a second)
            assert time.monotonic() < deadline, "the watcher never saw w2.key removed"
            time.sleep(0.02)
        b._apply_revocations(time.monotonic())  # what the loop does next
        looked = []
        real = b._key_removed
        monkeypatch.setattr(b, "_key_removed", lambda frame: looked.append(frame) or real(frame))
        c.connect(cfg.frontend)
        c.send_multipart(P.client_request("mmi.service", [b"svc"]))
        assert b.frontend.poll(5000)
        while b.frontend.poll(0):
            b._drain(b.frontend, b.on_client)
        assert c.poll(5000), "the ipc client's question was not answered"
        assert c.recv_multipart()[-1] == b"404"
        assert not looked, "an ipc client's REQUEST was looked up for a removed key (a worker's key was removed)"
    finally:
        c.close(0)
        b.close()
        ctx.term()


def test_a_slow_look_makes_the_watcher_look_less_often(setup, monkeypatch):
    """A directory of 100,000 keys took 0.5-0.7 s to look at (a stat of each entry), once a
    second: the broker's process spent more than half a core on it, for good, beside its
    loop (the GIL).  A look that takes long is followed by a wait 20 times as long."""
    curve, clients, made = setup
    looks = []
    real = S.allow_list_state

    def slow(directory):
        began = time.monotonic()
        time.sleep(0.03)  # the cost of a large directory's look
        state = real(directory)
        if threading.current_thread().name == "allow-lists":  # the watcher's (not the list's first, at start)
            looks.append((began, time.monotonic()))
        return state

    monkeypatch.setattr(S, "allow_list_state", slow)
    watcher = S.ServerCurve(zmq.Context.instance(), curve.plan, reload_period=0.005)
    watcher.start()
    try:
        deadline = time.monotonic() + 10
        while len(looks) < 2:
            assert time.monotonic() < deadline, "the watcher did not look twice within 10 s"
            time.sleep(0.01)
    finally:
        watcher.stop()
    (b0, e0), (b1, _) = looks[0], looks[1]
    assert b1 - e0 >= 10 * (e0 - b0), f"the next look came {b1 - e0:.3f} s after one that took {e0 - b0:.3f} s"


def test_a_change_between_the_start_s_read_and_its_watch_is_seen(tmp_path, monkeypatch):
    """The keys are read when the broker is made (`plan`), the directory's state when its
    ZAP handler starts: a key removed (or added) in between was in neither's difference,
    so no look ever saw it (until the next change).  The state is read before the keys."""
    made = {n: S.make_keys(str(tmp_path / "keys"), n)[0] for n in ("server", "a", "b")}
    clients = tmp_path / "clients"
    clients.mkdir()
    for n in ("a", "b"):
        shutil.copy(made[n], clients)
    real = S.load_allow_entries

    def then_removed(directory, what):
        entries = real(directory, what)
        os.unlink(clients / "a.key")  # removed just after the start read the list
        return entries

    monkeypatch.setattr(S, "load_allow_entries", then_removed)
    cfg = S.SecurityConfig(curve_secret=str(tmp_path / "keys" / "server.key_secret"), client_keys=str(clients))
    plan = S.plan(cfg, "tcp://127.0.0.1:0", "ipc:///nowhere/b.ipc")
    monkeypatch.setattr(S, "load_allow_entries", real)
    ctx = zmq.Context()
    curve = S.ServerCurve(ctx, plan, reload_period=0)
    curve.start()
    try:
        a = _z85(made["a"])
        assert curve.allowed("frontend", a)  # the list read at the start
        curve.reload()
        assert not curve.allowed("frontend", a), "a key removed as the broker started was never refused"
    finally:
        curve.stop()
        ctx.term()


def test_a_directory_that_cannot_be_listed_is_said_so(tmp_path, monkeypatch, caplog):
    """Permissions taken away (chmod 000, another owner): the previous list stays, and the
    ERROR says the directory cannot be listed; glob swallowed the error, and the line said
    it "holds no public certificate (*.key); copy the NAME.key file ... in there"."""
    made = S.make_keys(str(tmp_path / "keys"), "a")[0]
    d = tmp_path / "clients"
    d.mkdir()
    shutil.copy(made, d)
    real = os.scandir

    def refused(path="."):
        if os.fspath(path).rstrip("/") == str(d):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", refused)  # what a directory of mode 000 does to a non-root broker
    with pytest.raises(S.SecurityError) as e:
        S.load_allow_list(str(d), "client")
    assert "Permission denied" in str(e.value) and "no public certificate" not in str(e.value), str(e.value)
