"""Client mistakes get typed client errors, promptly, never a server fault or a silent wait:
inputs that do not match a model's declared inputs, an opaque reply to a tensor call, and
`infer()` on a streaming service."""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import zmq

from client_sdk import Client, InvalidInput, NotSupported, ProtocolError
from tests.e2e.conftest import wait_service


def test_client_mistakes_are_typed_client_errors_not_server_faults(cluster):
    """A wrong dtype, shape or input name for a model that declares its inputs: 422
    InvalidInput naming the mismatch and the signature, and the model does not run."""
    cluster.broker()
    cluster.worker("gate_model:declared", "--service", "declared")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "declared")
        good = np.full((4, 6, 3), 200, np.uint8)
        with c.infer("declared", {"image": good}) as r:
            np.testing.assert_array_equal(r["image"], good // 2)
        for inputs, why in (({"image": good.astype(np.float32)}, "has dtype <f4, expected |u1"),
                            ({"image": good[..., :2].copy()}, "has shape [4, 6, 2], expected [?, ?, 3]"),
                            ({"frame": good}, "missing input 'image' and unexpected input 'frame'")):
            with pytest.raises(InvalidInput, match=re.escape("service 'declared' takes image: |u1[?, ?, 3]")) as info:
                c.infer("declared", inputs)
            assert why in str(info.value) and info.value.code == 422
            assert str(info.value).endswith("(send inputs that match it; the model did not run)"), info.value


def test_infer_on_a_streaming_service_says_to_use_infer_stream(cluster):
    cluster.broker()
    cluster.worker("chunks")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "chunks")
        with pytest.raises(NotSupported, match="streams its results .* use infer_stream"):
            c.infer("chunks", {"x": np.arange(12, dtype=np.int32).reshape(3, 4)})
        assert len(list(c.infer_stream("chunks", {"x": np.ones((2, 4), np.int32)}))) >= 2  # the right call


def test_an_opaque_reply_to_a_tensor_call_is_a_typed_error_not_a_timeout(cluster):
    """A plain MDP worker (opaque bodies) registered under a name a tensor client calls."""
    cluster.broker()
    w = zmq.Context.instance().socket(zmq.DEALER)
    w.linger = 0
    stop = threading.Event()

    def plain_worker():
        while not stop.is_set():
            if w.poll(50):
                f = w.recv_multipart()
                if f[1] == b"\x02":  # REQUEST: answer with the body's length, as text
                    w.send_multipart([b"MDPW02", b"\x04", f[2], b"", str(len(f[4])).encode()])
            else:
                w.send_multipart([b"MDPW02", b"\x05"])  # HEARTBEAT: the broker's window is 0.6 s

    t = threading.Thread(target=plain_worker)
    try:
        w.connect(cluster.backend)
        w.send_multipart([b"MDPW02", b"\x01", b"plain"])
        t.start()
        with Client(cluster.frontend, timeout=30) as c:
            wait_service(c, "plain")
            with pytest.raises(ProtocolError, match="opaque body .* use client.request"):
                c.infer("plain", {"x": np.zeros(4)}, timeout=30)  # fails at once, not after 30 s
            assert c.request("plain", [b"abc"]) == [b"3"]
    finally:
        stop.set()
        if t.is_alive():
            t.join(5)
        w.close()


@pytest.mark.parametrize("blocking", [True, False], ids=["Client", "AsyncClient"])
def test_a_client_pointed_at_the_brokers_backend_is_told_to_check_the_endpoint(cluster, blocking):
    # The backend answers a client nothing: the call timed out advising "raise `timeout`,
    # lower the load, or add workers", and the broker logged "malformed worker message".
    import asyncio

    from client_sdk import AsyncClient, DeadlineExceeded

    broker = cluster.broker()  # 0.2 s heartbeats: the client's are 1 s, its timeout 2 s
    x = {"x": np.zeros(3)}
    with pytest.raises(DeadlineExceeded) as info:
        if blocking:
            with Client(cluster.backend, timeout=2) as c:
                c.infer("echo", x)
        else:
            async def call():
                async with AsyncClient(cluster.backend, timeout=2) as c:
                    await c.infer("echo", x)

            asyncio.run(call())
    assert f"nothing at all has come from {cluster.backend}" in str(info.value)
    assert "the broker's frontend endpoint" in str(info.value) and "raise `timeout`" not in str(info.value)
    broker.wait_log(f"a client (MDPC02) sent to the backend {cluster.backend}: clients connect to the frontend")


async def _async_mmi_and_request(endpoint):
    from client_sdk import AsyncClient, DeadlineExceeded

    async with AsyncClient(endpoint, timeout=0.5) as c:
        for ask in (lambda: c.mmi_service("echo", timeout=0.5), lambda: c.request("echo", [b"hi"], timeout=0.5)):
            with pytest.raises(DeadlineExceeded) as info:
                await ask()
            assert f"the broker never answered: no socket at {endpoint[len('ipc://'):]}" in str(info.value)
            assert "lower the load" not in str(info.value)


def test_mmi_and_opaque_requests_that_never_reached_a_broker_say_why(tmp_path):
    # client.md ("Errors"): a DeadlineExceeded of a client that never heard from its broker
    # says what the kernel says of the socket file.  Infer did; `mmi_service` (what
    # `python -m bench run` asks first) and `request` said "lower the load, or add workers".
    import asyncio

    from client_sdk import DeadlineExceeded

    endpoint = f"ipc://{tmp_path / 'missing.ipc'}"
    with Client(endpoint, timeout=0.5) as c:
        for ask in (lambda: c.mmi_service("echo", timeout=0.5), lambda: c.request("echo", [b"hi"], timeout=0.5)):
            with pytest.raises(DeadlineExceeded) as info:
                ask()
            assert f"the broker never answered: no socket at {tmp_path / 'missing.ipc'}" in str(info.value)
            assert "lower the load" not in str(info.value)
    asyncio.run(_async_mmi_and_request(endpoint))


OTHER_USER = """
import sys
import numpy as np
from client_sdk import Client, DeadlineExceeded
try:
    with Client(sys.argv[1], timeout=1) as c:
        c.infer("echo", {"x": np.zeros(3)})
except DeadlineExceeded as e:
    print(e)
"""


def test_a_call_that_never_reached_a_broker_says_why(cluster, tmp_path):
    # libzmq retries a failing ipc connect in silence: a client started before its broker, one
    # left with the socket file of a broker that died, and one run as another user (the
    # runtime directory is 0700) each ran out of time with "raise `timeout`, lower the load,
    # or add workers" (the last two leftovers of earlier sessions' notes).
    import os
    import socket
    import subprocess
    import sys

    from client_sdk import BrokerUnreachable, DeadlineExceeded

    x = {"x": np.zeros(3)}
    missing = tmp_path / "missing.ipc"
    with Client(f"ipc://{missing}", timeout=0.5) as c:
        with pytest.raises(DeadlineExceeded, match=re.escape(f"the broker never answered: no socket at {missing} "
                                                             "(no broker is bound there")):
            c.infer("echo", x)
    stale = tmp_path / "stale.ipc"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # closed: the file stays, nothing listens
    with Client(f"ipc://{stale}", timeout=None, heartbeat_interval=0.1) as c:
        with pytest.raises(BrokerUnreachable, match=re.escape(f"nothing listens on {stale} (the broker that bound "
                                                              "it is gone")):
            c.infer("echo", x)
    # Another user's runtime directory: root without the capabilities that override file
    # permissions (setpriv) stands in for that user (it is the directory's owner that counts).
    import shutil

    setpriv = shutil.which("setpriv")
    if os.getuid() != 0 or setpriv is None:
        pytest.skip("the other-user case needs root and setpriv(1)")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    cluster.frontend = f"ipc://{theirs}/fe.ipc"
    cluster.broker()
    p = subprocess.run([setpriv, "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c", OTHER_USER,
                        cluster.frontend], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"permission denied on {theirs}/fe.ipc (its directory is another user's" in p.stdout, (p.stdout,
                                                                                                  p.stderr[-2000:])
    assert "run it as the broker's user" in p.stdout and "raise `timeout`" not in p.stdout
