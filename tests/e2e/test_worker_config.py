"""One deploy file for every process: `python -m broker --config FILE --pool NAME` becomes one
worker of that `[[pool]]`, started as the launcher would start it (issue 12: "the same file
serves every process"), for workers that run in a container of their own."""
from __future__ import annotations

import numpy as np
import pytest

from client_sdk import Client
from broker.__main__ import pool_worker_argv as pool_argv
from tests.e2e.conftest import Proc, wait_service


def _deploy(tmp_path, backend: str) -> str:
    path = tmp_path / "deploy.toml"
    path.write_text(f'''
frontend = "ipc://{tmp_path}/fe.ipc"
backend = "{backend}"

[scheduler]
heartbeat_interval = 0.2

[[pool]]
name = "tiny"
model = "echo"
service = "tiny-echo"
max_batch = 4
extra_args = ["--out-capacity-mb", "64"]
''')
    return str(path)


def test_pool_argv_is_the_launchers_command_line(tmp_path):
    be = f"ipc://{tmp_path}/be.ipc"
    argv = pool_argv(_deploy(tmp_path, be), "tiny")
    assert argv[:2] == [f"--broker={be}", "--model=echo"]
    assert "--heartbeat-interval=0.2" in argv and "--service=tiny-echo" in argv and "--max-batch=4" in argv
    assert argv[-2:] == ["--out-capacity-mb", "64"]  # extra_args last


def test_an_unknown_pool_or_a_missing_half_is_one_line_and_exit_2(tmp_path):
    cfg = _deploy(tmp_path, f"ipc://{tmp_path}/be.ipc")
    with pytest.raises(ValueError, match="no \\[\\[pool\\]\\] named 'nope' \\(pools: tiny\\)"):
        pool_argv(cfg, "nope")
    for args in (["--config", cfg, "--pool", "nope"], ["--pool", "tiny"], ["--config", cfg, "--pool"],
                 ["--config", cfg, "--pool", "tiny", "--frontend", "ipc:///x"]):
        p = Proc(["-m", "broker", *args])
        try:
            assert p.p.wait(60) == 2
            err = p.stderr().strip()
            assert len(err.splitlines()) == 1 and err.startswith("python -m broker: "), err
        finally:
            p.close()


def test_a_bind_address_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="where the broker binds"):
        pool_argv(_deploy(tmp_path, "tcp://*:5556"), "tiny")


def test_a_worker_from_the_deploy_file_serves_and_later_flags_override_it(tmp_path):
    be = f"ipc://{tmp_path}/be.ipc"
    cfg = _deploy(tmp_path, be)
    broker = Proc(["-m", "broker", "--frontend", f"ipc://{tmp_path}/fe.ipc", "--backend", be,
                   "--heartbeat-interval", "0.2"])
    procs = [broker]
    try:
        broker.wait_ready()
        # --service after `--` wins over the file's: the pool says tiny-echo.
        worker = Proc(["-m", "broker", "--config", cfg, "--pool", "tiny", "--", "--service", "renamed"])
        procs.append(worker)
        assert "service=renamed" in worker.wait_ready()
        with Client(f"ipc://{tmp_path}/fe.ipc", timeout=20) as c:
            wait_service(c, "renamed")
            x = np.arange(8, dtype=np.float32)
            with c.infer("renamed", {"x": x}) as r:
                np.testing.assert_array_equal(r["x"], x)
    finally:
        for p in reversed(procs):
            p.close()


@pytest.mark.parametrize("args, words", [
    (["--service-grace", "nan"], "--service-grace must be from 0 to 86400"),  # crashed the running broker later
    (["--heartbeat-interval", "inf"], "--heartbeat-interval must be from 0.001 to 3600"),  # a traceback
    (["--heartbeat-interval", "1e-9"], "--heartbeat-interval must be from 0.001"),  # a busy loop
    # a 1 ms liveness window: every worker presumed dead and reconnecting, requests failed
    (["--heartbeat-interval", "0.01", "--heartbeat-liveness", "3"], "(the liveness window) must be at least 0.1 s"),
    (["--heartbeat-liveness", "1"], "--heartbeat-liveness must be from 2 to 1000"),  # idle workers flapped
    (["--max-frame-mb", "0"], "--max-frame-mb must be from"),  # clamped to 1 byte: every client dropped
    (["--http", ""], "--http is empty"),  # metrics and health off, over the file's http, silently
    (["--frontend", "inproc://x"], "frontend inproc://x: an inproc:// endpoint is reachable only"),  # READY, unreachable
    (["--client-hwm", "99999999999"], "--client-hwm must be from 1 to 2147483647"),  # an OverflowError
    (["--max-client-mb", "-1"], "--max-client-mb must be from 0"),  # clamped to 0
    (["--frontend", "tcp://127.0.0.1:99999", "--insecure"], "port 99999 is not from 0 to 65535"),  # wrapped
    (["--backend", "FRONTEND"], "the frontend and the backend are both"),  # "another broker?"
    # abbreviations: taken by the broker, refused by the worker (now by both)
    (["--heartbeat-int", "0.5"], "unrecognized arguments: --heartbeat-int"),
])
def test_a_broker_flag_out_of_its_range_is_one_line_and_exit_2(tmp_path, args, words):
    """Found by the command-line hunt: each of these started a broker that crashed, spun or
    did something else than asked; now one line naming the flag, exit 2."""
    base = ["--frontend", f"ipc://{tmp_path}/fe.ipc", "--backend", f"ipc://{tmp_path}/be.ipc"]
    args = [f"ipc://{tmp_path}/fe.ipc" if a == "FRONTEND" else a for a in args]
    p = Proc(["-m", "broker", *base, *args])
    try:
        assert p.p.wait(60) == 2
        assert words in p.stderr(), p.stderr()
    finally:
        p.close()


def test_a_file_at_an_ipc_endpoint_path_is_never_removed(tmp_path):
    """Found by the command-line hunt: a regular file at the frontend's path was unlinked as
    if it were a stale socket."""
    precious = tmp_path / "precious.txt"
    precious.write_text("data")
    p = Proc(["-m", "broker", "--frontend", f"ipc://{precious}", "--backend", f"ipc://{tmp_path}/be.ipc"])
    try:
        assert p.p.wait(60) == 2
        assert "exists and is not a socket" in p.stderr(), p.stderr()
    finally:
        p.close()
    assert precious.read_text() == "data"


def test_an_inproc_endpoint_in_the_file_and_a_drain_timeout_beside_pools_are_refused(tmp_path):
    """A file's `frontend = "inproc://x"` started a broker that printed READY where no other
    process could reach it; --drain-timeout-s beside [[pool]] tables was silently ignored
    (a launcher drains for its file's drain_timeout_s).  Both: one line, exit 2."""
    path = tmp_path / "deploy.toml"
    for text, args, words in (
            ('frontend = "inproc://x"\n', (), "frontend inproc://x: an inproc:// endpoint is reachable only"),
            ("[[pool]]\nmodel = 'echo'\n", ("--drain-timeout-s", "5"), "--drain-timeout-s is for a broker without")):
        path.write_text(f'backend = "ipc://{tmp_path}/be.ipc"\n' + text)
        p = Proc(["-m", "broker", "--config", str(path), *args])
        try:
            assert p.p.wait(60) == 2
            assert words in p.stderr(), p.stderr()
        finally:
            p.close()


def test_a_deploy_file_value_out_of_its_range_names_the_file_and_is_exit_2(tmp_path):
    for text, words in (("[scheduler]\nservice_grace = nan\n", "service_grace"),
                        ("[scheduler]\nclient_liveness = 0\n", "[scheduler] client_liveness must be from 0.1"),
                        ("client_hwm = 99999999999\n", "client_hwm must be an integer from 1 to 2147483647"),
                        ("[[pool]]\nmodel = 'echo'\n[launcher]\nready_timeout_s = 1e308\n",
                         "ready_timeout_s must be a number from 1 to 1e+06")):
        path = tmp_path / "deploy.toml"
        path.write_text(f'frontend = "ipc://{tmp_path}/fe.ipc"\nbackend = "ipc://{tmp_path}/be.ipc"\n' + text)
        p = Proc(["-m", "broker", "--config", str(path)])
        try:
            assert p.p.wait(60) == 2
            err = p.stderr()
            assert words in err and str(path) in err, err
        finally:
            p.close()
