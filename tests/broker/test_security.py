"""CurveZMQ settings and ipc hardening, without a broker process: key files and their modes,
the `keys` CLI, allow-lists, the TOML `[security]` table, the refusal to serve tcp without
keys, the client's and the worker's key checks, the runtime directory's ownership and the
0600 socket files.  The attacks against a live broker are in tests/e2e/test_tcp_security.py."""
from __future__ import annotations

import logging
import os
import stat
import textwrap

import pytest
import zmq
import zmq.auth

from broker import __main__ as broker_main
from broker import protocol as P
from broker import security as S
from broker.protocol import curve as C
from broker.protocol.naming import RuntimeDirError, default_runtime_dir
from broker.server import Broker, BrokerConfig
from client_sdk import AsyncClient, Client, InvalidInput
from client_sdk.sockets import ReplyInbox, curve_keys, tcp_options
from gpu_worker import __main__ as worker_main
from gpu_worker.upstream import BrokerLink, CurveKeyError, link_keys


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def keys(tmp_path):
    """A server, a client and a worker pair, and allow-lists holding the client and the worker."""
    d = tmp_path / "keys"
    out = {name: S.make_keys(str(d), name) for name in ("server", "client", "worker")}
    for side, name in (("clients", "client"), ("workers", "worker")):
        (tmp_path / side).mkdir()
        (tmp_path / side / f"{name}.key").write_bytes(open(out[name][0], "rb").read())
    return tmp_path, out


# ------------------------------------------------------------------------------------ keys

def test_make_keys_writes_a_pair_with_private_modes(tmp_path):
    d = tmp_path / "new" / "dir"
    public, secret = S.make_keys(str(d), "server")
    assert (public, secret) == (str(d / "server.key"), str(d / "server.key_secret"))
    assert _mode(d) == 0o700 and _mode(secret) == 0o600 and _mode(public) == 0o644
    pub, sec = zmq.auth.load_certificate(secret)
    assert zmq.auth.load_certificate(public) == (pub, None) and len(pub) == len(sec) == 40
    with pytest.raises(S.SecurityError, match="already exist"):
        S.make_keys(str(d), "server")
    assert zmq.auth.load_certificate(secret) == (pub, sec)  # kept
    assert S.make_keys(str(d), "server", overwrite=True) and zmq.auth.load_certificate(secret)[0] != pub
    for bad in ("", "../x", ".hidden", "a/b"):
        with pytest.raises(S.SecurityError, match="plain file name"):
            S.make_keys(str(d), bad)


def test_keys_cli(tmp_path, capsys):
    d = tmp_path / "k"
    assert broker_main.main(["keys", str(d)]) == 0
    assert broker_main.main(["keys", str(d), "--name", "client"]) == 0
    out = capsys.readouterr().out
    assert f"public {d}/server.key" in out and f"secret {d}/client.key_secret" in out
    assert sorted(os.listdir(d)) == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert _mode(d / "server.key_secret") == _mode(d / "client.key_secret") == 0o600
    assert broker_main.main(["keys", str(d), "--name", "client"]) == 2
    assert "already exist" in capsys.readouterr().err
    assert broker_main.main(["keys", str(d), "--name", "client", "--force"]) == 0


def test_allow_lists_and_server_secret(keys, tmp_path):
    root, k = keys
    assert S.load_allow_list(str(root / "clients"), "client") == {zmq.auth.load_certificate(k["client"][0])[0]}
    with pytest.raises(S.SecurityError, match="not a directory"):
        S.load_allow_list(str(root / "missing"), "client")
    (root / "empty").mkdir()
    with pytest.raises(S.SecurityError, match="holds no public certificate"):
        S.load_allow_list(str(root / "empty"), "worker")
    (root / "clients" / "junk.key").write_text("not a certificate\n")
    with pytest.raises(S.SecurityError, match="junk.key") as e:
        S.load_allow_list(str(root / "clients"), "client")
    # (pyzmq's words named the descriptor read, /proc/self/fd/N; found by the security audit)
    assert "/proc/self" not in str(e.value) and "holds no public-key line" in str(e.value), str(e.value)
    with pytest.raises(S.SecurityError, match="no secret key"):
        S.load_server_secret(k["server"][0])  # the public half
    assert S.load_server_secret(k["server"][1]) == zmq.auth.load_certificate(k["server"][1])


def test_key_values(keys):
    _, k = keys
    pub = zmq.auth.load_certificate(k["server"][0])[0]
    assert C.load_public_key(k["server"][0]) == pub
    assert C.load_public_key(k["server"][1]) == pub   # a secret certificate gives its public half
    assert C.load_public_key(pub.decode()) == pub == C.load_public_key(pub)
    for bad in ("/no/such/file.key", "x" * 39, "#" * 40, "~" * 40, 42):
        with pytest.raises(C.CurveKeyError):
            C.load_public_key(bad)
    with pytest.raises(C.CurveKeyError, match="key_secret"):
        C.load_secret_cert(k["client"][0])
    assert "secret" not in repr(C.PeerKeys(b"a" * 40, b"b" * 40, b"c" * 40)).replace("PeerKeys", "")


# ------------------------------------------------------------------------------------ broker settings

def test_plan_refuses_tcp_without_keys_and_names_the_flags(keys):
    root, k = keys
    with pytest.raises(S.SecurityError) as e:
        S.plan(S.SecurityConfig(), "tcp://127.0.0.1:5555", "ipc:///tmp/x.ipc")
    for flag in ("--curve-secret", "--client-keys", "--insecure", "python -m broker keys", "tcp://127.0.0.1:5555"):
        assert flag in str(e.value)
    with pytest.raises(S.SecurityError, match="--worker-keys"):
        S.plan(S.SecurityConfig(curve_secret=k["server"][1], client_keys=str(root / "clients")),
               "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    with pytest.raises(S.SecurityError, match="pass one or the other"):
        S.plan(S.SecurityConfig(insecure=True, curve_secret=k["server"][1]), "tcp://127.0.0.1:1", "ipc:///x")
    # ipc needs nothing; insecure lists its plain tcp endpoints; keys make CURVE sockets.
    assert not S.plan(S.SecurityConfig(), "ipc:///a", "ipc:///b").enabled
    assert S.plan(S.SecurityConfig(insecure=True), "tcp://127.0.0.1:1", "ipc:///b").insecure == ("tcp://127.0.0.1:1",)
    p = S.plan(S.SecurityConfig(curve_secret=k["server"][1], client_keys=str(root / "clients"),
                                worker_keys=str(root / "workers")), "tcp://127.0.0.1:1", "ipc:///b")
    assert p.enabled and p.domain_of("frontend") == S.FRONTEND_DOMAIN and p.domain_of("backend") is None


def test_keys_for_endpoints_that_are_not_tcp_are_a_warning(keys, caplog):
    """They are not needed, and were ignored without a word: an operator who meant tcp
    learns it from this line (the command-line hunt)."""
    root, k = keys
    with caplog.at_level(logging.WARNING, logger="broker"):
        assert not S.plan(S.SecurityConfig(curve_secret=k["server"][1]), "ipc:///a", "ipc:///b").enabled
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("--curve-secret given") and "frontend ipc:///a is not tcp" in line, line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="broker"):
        S.plan(S.SecurityConfig(curve_secret=k["server"][1], client_keys=str(root / "clients"),
                                worker_keys=str(root / "workers")), "tcp://127.0.0.1:1", "ipc:///b")
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("--worker-keys given") and "the backend ipc:///b is not tcp" in line, line
    assert "frontend" not in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="broker"):
        S.plan(S.SecurityConfig(curve_secret=k["server"][1], client_keys=str(root / "clients")),
               "tcp://127.0.0.1:1", "ipc:///b")
    assert caplog.records == []


@pytest.mark.parametrize("ep", ["ipc://@zinf-abstract", "tipc://{5560,0,0}", "udp://127.0.0.1:5555"])
def test_plan_refuses_endpoints_nothing_guards(ep):
    # An abstract unix socket has no file permissions, other transports reach the network:
    # only tcp with CURVE, ipc socket files and inproc are served without --insecure.
    with pytest.raises(S.SecurityError, match="--insecure"):
        S.plan(S.SecurityConfig(), ep, "ipc:///tmp/b.ipc")
    assert not S.plan(S.SecurityConfig(), "inproc://a", "ipc:///tmp/b.ipc").enabled
    assert not S.plan(S.SecurityConfig(insecure=True), ep, "ipc:///tmp/b.ipc").enabled


def test_toml_security_table(keys, tmp_path):
    root, k = keys
    cfg_file = root / "broker.toml"
    cfg_file.write_text(textwrap.dedent("""
        [broker]
        frontend = "tcp://127.0.0.1:0"
        backend = "tcp://127.0.0.1:0"
        [broker.security]
        curve_secret = "keys/server.key_secret"
        client_keys = "clients"
        worker_keys = "workers"
        [broker.scheduler]
        max_queue = 7
    """))
    cfg = BrokerConfig.from_toml(str(cfg_file))
    assert cfg.security == S.SecurityConfig(curve_secret=str(root / "keys/server.key_secret"),
                                            client_keys=str(root / "clients"), worker_keys=str(root / "workers"))
    assert cfg.scheduler.max_queue == 7
    with Broker(cfg, ctx=zmq.Context()) as b:  # serves CURVE on both (binding is enough here)
        assert b.frontend.curve_server and b.backend.curve_server
        assert b.frontend.zap_domain == S.FRONTEND_DOMAIN.encode()
        assert b.backend.zap_domain == S.BACKEND_DOMAIN.encode()
    b.ctx.term()
    for table, msg in (('insecure = "yes"', "true or false"), ("curve_secret = 3", "a path"),
                       ("curve_key = 'x'", "unknown security option")):
        cfg_file.write_text(f"[broker.security]\n{table}\n")
        with pytest.raises(S.SecurityError, match=msg):
            BrokerConfig.from_toml(str(cfg_file))
    assert BrokerConfig().security == S.SecurityConfig()


def test_broker_refuses_tcp_without_keys_before_binding(tmp_path, capsys):
    ctx = zmq.Context()
    try:
        with pytest.raises(S.SecurityError, match="--insecure"):
            Broker(BrokerConfig(frontend="tcp://127.0.0.1:0", backend=f"ipc://{tmp_path}/be.ipc"), ctx=ctx)
        assert not os.path.exists(tmp_path / "be.ipc")
    finally:
        ctx.term()  # would hang on a socket left open
    fe = "tcp://127.0.0.1:0"
    assert broker_main.main(["--frontend", fe, "--backend", f"ipc://{tmp_path}/be.ipc"]) == 2
    err = capsys.readouterr().err
    assert "--curve-secret" in err and "--insecure" in err and fe in err


def test_ipc_sockets_are_0600(tmp_path):
    ctx = zmq.Context()
    with Broker(BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc"), ctx=ctx) as b:
        assert not b.frontend.curve_server
        assert _mode(tmp_path / "fe.ipc") == _mode(tmp_path / "be.ipc") == 0o600
    inbox = ReplyInbox.open(ctx)
    try:
        assert inbox is not None and _mode(inbox.path) == 0o600
    finally:
        inbox.close()
    # Made 0600, not chmodded after: with a permissive umask the file was open to other
    # users between the bind and the chmod (the security audit).  The mode the file has as
    # libzmq's bind returns, before the chmod, read from inside the bind.
    seen = []
    real_bind = zmq.Socket.bind

    def bind(sock, ep):
        out = real_bind(sock, ep)
        if ep.startswith("ipc://"):
            seen.append(_mode(ep[len("ipc://"):]))
        return out

    old = os.umask(0)
    try:
        zmq.Socket.bind = bind
        with Broker(BrokerConfig(frontend=f"ipc://{tmp_path}/fe2.ipc", backend=f"ipc://{tmp_path}/be2.ipc"), ctx=ctx):
            pass
    finally:
        zmq.Socket.bind = real_bind
        os.umask(old)
    assert seen == [0o600, 0o600], [oct(m) for m in seen]
    ctx.term()


# ------------------------------------------------------------------------------------ runtime directory

def test_runtime_dir_is_narrowed_to_0700(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    d = tmp_path / f"zmq-infer-{os.getuid()}"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o757)
    assert default_runtime_dir() == str(d) and _mode(d) == 0o700
    assert P.default_endpoints()[0] == f"ipc://{d}/frontend.ipc"


def test_runtime_dir_that_is_a_symlink_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", tmp_path / f"zmq-infer-{os.getuid()}")
    with pytest.raises(RuntimeDirError, match="not a plain directory"):
        default_runtime_dir()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory owned by another uid")
def test_runtime_dir_of_another_user_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    d = tmp_path / f"zmq-infer-{os.getuid()}"
    d.mkdir()
    os.chmod(d, 0o777)
    os.chown(d, 65534, 65534)  # what an attacker who got there first in /tmp would leave
    with pytest.raises(RuntimeDirError, match="belongs to uid 65534"):
        default_runtime_dir()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o777  # not ours to change
    assert broker_main.main([]) == 2  # the broker's defaults live there: it refuses to start
    assert "belongs to uid 65534" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ clients and workers

@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_client_refuses_tcp_without_keys(cls, keys, monkeypatch):
    monkeypatch.delenv(C.ENV_SERVER_KEY, raising=False)
    monkeypatch.delenv("ZMQ_INFER_CLIENT_KEY", raising=False)
    _, k = keys
    with pytest.raises(InvalidInput) as e:
        cls("tcp://127.0.0.1:1")
    for fix in ("server_key=", "client_key=", "insecure=True", "python -m broker keys"):
        assert fix in str(e.value)
    with pytest.raises(InvalidInput, match="client_key="):
        cls("tcp://127.0.0.1:1", server_key=k["server"][0])
    with pytest.raises(InvalidInput, match="public certificate"):
        cls("tcp://127.0.0.1:1", server_key=k["server"][0], client_key=k["client"][0])
    with pytest.raises(InvalidInput, match="one or the other"):
        cls("tcp://127.0.0.1:1", server_key=k["server"][0], insecure=True)
    with pytest.raises(InvalidInput, match="transport='shm'"):
        cls("tcp://127.0.0.1:1", transport="shm", insecure=True)


def test_client_curve_options(keys, monkeypatch):
    _, k = keys
    assert curve_keys("ipc:///x", None, None, False) is None
    assert curve_keys("tcp://127.0.0.1:1", None, None, True) is None
    got = curve_keys("tcp://127.0.0.1:1", k["server"][0], k["client"][1], False)
    assert (got.server, got.public, got.secret) == (zmq.auth.load_certificate(k["server"][0])[0],
                                                    *zmq.auth.load_certificate(k["client"][1]))
    monkeypatch.setenv(C.ENV_SERVER_KEY, k["server"][0])
    monkeypatch.setenv("ZMQ_INFER_CLIENT_KEY", k["client"][1])
    assert curve_keys("tcp://127.0.0.1:1", None, None, False) == got
    assert tcp_options("tcp://127.0.0.1:1", "auto", True) == ("inline", False)
    assert tcp_options("ipc:///x", "auto", True) == ("auto", True)
    with Client("tcp://127.0.0.1:1", timeout=1) as c:  # keys from the environment; connecting is lazy
        assert not c.uses_shm and c.direct_replies == 0
        assert c._sock.mechanism == zmq.CURVE and c._inbox is None


@pytest.mark.parametrize("who", ["client", "worker"])
def test_a_bad_key_from_the_environment_is_named_so(who, keys, monkeypatch, tmp_path):
    """A key read from $ZMQ_INFER_* that cannot be used names the variable (and the option that
    overrides it): the message named it as if it had been passed, and an operator who passed
    none could not tell where it came from (the configuration hunt)."""
    _, k = keys
    own_env, own_opt, server_opt = (("ZMQ_INFER_CLIENT_KEY", "client_key=", "server_key=") if who == "client" else
                                    ("ZMQ_INFER_WORKER_KEY", "--worker-key", "--server-key"))
    own = k[who][1]

    def keys_of(**kw):
        if who == "client":
            return curve_keys("tcp://127.0.0.1:1", kw.get("server"), kw.get("own"), False)
        return link_keys("tcp://127.0.0.1:1", kw.get("server"), kw.get("own"))

    error = InvalidInput if who == "client" else CurveKeyError
    monkeypatch.setenv(C.ENV_SERVER_KEY, "garbage")
    with pytest.raises(error, match=rf"'garbage' is neither .* \(from \$ZMQ_INFER_SERVER_KEY; {server_opt} "
                                    r"overrides it\)$"):
        keys_of(own=own)
    with pytest.raises(error) as e:
        keys_of(own=own, server="garbage")  # passed: no variable named
    assert "ZMQ_INFER_SERVER_KEY" not in str(e.value)
    monkeypatch.setenv(C.ENV_SERVER_KEY, k["server"][0])
    monkeypatch.setenv(own_env, str(tmp_path / "gone.key_secret"))
    with pytest.raises(error, match=rf"gone.key_secret.* \(from \${own_env}; {own_opt} overrides it\)$"):
        keys_of()
    assert keys_of(own=own).public == zmq.auth.load_certificate(own)[0]  # the option overrides it


def test_worker_refuses_tcp_without_keys(keys, monkeypatch, capsys):
    monkeypatch.delenv(C.ENV_SERVER_KEY, raising=False)
    monkeypatch.delenv("ZMQ_INFER_WORKER_KEY", raising=False)
    _, k = keys
    with pytest.raises(CurveKeyError, match="--server-key and --worker-key"):
        link_keys("tcp://127.0.0.1:1")
    assert link_keys("ipc:///x") is None and link_keys("tcp://127.0.0.1:1", insecure=True) is None
    ctx = zmq.Context()
    link = BrokerLink("tcp://127.0.0.1:1", ctx, server_key=k["server"][0], worker_key=k["worker"][1])
    assert link.curve.server == zmq.auth.load_certificate(k["server"][0])[0]
    assert link.curve.public == zmq.auth.load_certificate(k["worker"][1])[0]
    assert link.open().mechanism == zmq.CURVE
    link.close()
    ctx.term()
    assert worker_main.main(["--broker", "tcp://127.0.0.1:1", "--model", "echo"]) == 2
    err = capsys.readouterr().err
    assert "--server-key" in err and "--worker-key" in err and "--insecure" in err


def test_tcp_request_checks():
    inline = P.TensorRef("x", "<f4", [1], P.InlineLoc(0))
    shm = P.TensorRef("x", "<f4", [1], P.ShmLoc("zinf-1", 0, 4, 0, 1))
    cuda = P.TensorRef("x", "<f4", [1], P.CudaLoc("pool", 0, 4, 0))
    assert not S.names_local_memory(P.Request(id=1, tensors=[inline]))
    assert S.names_local_memory(P.Request(id=1, tensors=[inline, shm]))
    assert S.names_local_memory(P.Request(id=1, tensors=[cuda]))
    assert S.names_local_memory(P.Request(id=1, host="h", reply_to="ipc:///tmp/c.ipc"))
    assert not S.peer_is_tcp(b"not a received frame")


def test_a_tcp_clients_principal_is_its_key_across_connections(keys):
    """Caps and the round-robin count a CURVE client by its key, not by its connection:
    two sockets with one key are one principal (broker.state, "Connections and principals")."""
    import threading
    import time

    root, k = keys
    from broker.state import Config

    cfg = BrokerConfig(frontend="tcp://127.0.0.1:0", backend="ipc://" + str(root / "be.ipc"),
                       scheduler=Config(service_grace=60),  # queued until the test has looked
                       security=S.SecurityConfig(curve_secret=k["server"][1], client_keys=str(root / "clients")))
    stop = threading.Event()
    with Broker(cfg) as b:
        t = threading.Thread(target=b.serve, args=(stop,))
        t.start()
        socks = []
        try:
            pub, sec = zmq.auth.load_certificate(k["client"][1])
            server_pub = zmq.auth.load_certificate(k["server"][0])[0]
            for i in range(2):
                s = zmq.Context.instance().socket(zmq.DEALER)
                s.linger = 0
                C.configure_peer(s, C.PeerKeys(server=server_pub, public=pub, secret=sec))
                s.connect(b.frontend_ep)
                socks.append(s)
                # No worker serves it, so the request stays queued (for service_grace).
                s.send_multipart(P.client_request("nobody", [P.encode_header(P.Request(id=1))]))
            deadline = time.monotonic() + 10
            while b.sched.client_usage(f"curve:{pub.decode()}")["outstanding"] < 2:
                assert time.monotonic() < deadline, b.sched.stats()
                time.sleep(0.01)
        finally:
            stop.set()
            t.join(10)
            for s in socks:
                s.close(0)


def _devnull_fds() -> int:
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{name}") == os.devnull
        except OSError:
            pass
    return n


def test_a_look_at_a_frames_descriptor_that_a_file_took_leaks_no_descriptor(tmp_path):
    """A frame's SRCFD names the number its connection had; read after that connection
    closed, the number may be a file's.  `peer_is_tcp` and the broker's end of a client that
    stopped reading (`Broker._end_connection`) look at it through a copy, which
    `socket.socket` refused and kept open: a descriptor leaked per look (the review of the
    churn hunt).  Neither leaves one now."""
    from broker.server import Broker, BrokerConfig

    null = os.open(os.devnull, os.O_RDONLY)

    class Frame:
        def get(self, what):
            return null

    cfg = BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc")
    try:
        with Broker(cfg) as b:
            before = _devnull_fds()
            assert S.peer_is_tcp(Frame(), unknown=None) is None
            b._client_conn[b"C"] = null
            b._end_connection(b"C")
            assert _devnull_fds() == before, f"{_devnull_fds() - before} descriptors leaked"
    finally:
        os.close(null)


def test_a_secret_certificate_where_a_public_one_will_do_is_taken_and_said(keys, caplog):
    """A client given the broker's server.key_secret as its server key (or a secret
    certificate copied into an allow-list as NAME.key) works, silently before: a secret
    spread where it need not be (the security audit)."""
    root, k = keys
    caplog.set_level(logging.WARNING, logger="broker.protocol")
    assert C.load_public_key(k["server"][1]) == zmq.auth.load_certificate(k["server"][0])[0]
    assert "is a secret certificate: its public half is used" in caplog.text
    caplog.clear()
    assert C.load_public_key(k["server"][0]) == zmq.auth.load_certificate(k["server"][0])[0]
    assert not caplog.text


def test_an_allow_list_others_may_write_to_is_warned_of(keys, caplog):
    # Whoever can copy a key into an allow-list is let in within a second (the reload): a
    # directory writable by others was taken without a word (the security audit).
    root, k = keys
    clients = root / "clients"
    cfg = S.SecurityConfig(curve_secret=k["server"][1], client_keys=str(clients))
    with caplog.at_level(logging.WARNING, logger="broker"):
        S.plan(cfg, "tcp://127.0.0.1:1", "ipc:///b")
    assert "writable by others" not in caplog.text
    os.chmod(clients, 0o777)
    try:
        with caplog.at_level(logging.WARNING, logger="broker"):
            S.plan(cfg, "tcp://127.0.0.1:1", "ipc:///b")
    finally:
        os.chmod(clients, 0o755)
    assert "is writable by others (mode 777): whoever can write a key there is let in" in caplog.text
