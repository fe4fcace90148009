"""Deployments an operator gets subtly wrong: processes of one host that cannot share memory
because they run as different users.  Each must keep working (by copying) or fail in one
clear line; none may fail a call with an error that blames a protocol bug."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from client_sdk import Client
from tests.children import readline_within

from .conftest import ROOT, Proc

NOBODY = 65534
SETPRIV = shutil.which("setpriv")
AS_NOBODY = [SETPRIV or "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

needs_root = pytest.mark.skipif(os.getuid() != 0 or SETPRIV is None, reason="needs root and setpriv(1)")


def _nobody_can_run_this_python() -> None:
    """Skip unless uid 65534 can start this interpreter and import the project with it.  A Python
    built with --enable-shared inside a 0700 home (pyenv's in /root) is out of its reach: on
    3.12.1 the loader stops at "libpython3.12.so.1.0: cannot open shared object file".  (A pyenv
    3.11 there starts all the same, by chance: the loader falls back to Debian's libpython3.11.)"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([*AS_NOBODY, sys.executable, "-c", "import broker, gpu_worker, client_sdk"],
                       capture_output=True, text=True, timeout=30, cwd=ROOT, env=env)
    if r.returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot run {sys.executable} with this tree: {r.stderr.strip()[-300:]}")


@pytest.fixture
def nobody_dir():
    """A directory uid 65534 owns, outside pytest's 0700 tree, with a runtime directory in it."""
    _nobody_can_run_this_python()
    d = tempfile.mkdtemp(prefix="zinf-op-")
    os.chmod(d, 0o755)
    os.chown(d, NOBODY, NOBODY)
    rt = os.path.join(d, "rt")
    os.mkdir(rt, 0o700)
    os.chown(rt, NOBODY, NOBODY)
    procs: list[Proc] = []
    try:
        yield d, procs
    finally:
        for p in reversed(procs):  # workers first, then the broker
            p.close()
        shutil.rmtree(d, ignore_errors=True)


def _start(procs, args, *, nobody: bool, rt: str) -> Proc:
    p = Proc(args, env={"XDG_RUNTIME_DIR": rt}, prefix=AS_NOBODY if nobody else ())
    procs.append(p)
    p.wait_ready()
    return p


NOBODY_CLIENT = """
import sys
import numpy as np
from client_sdk import Client
with Client(sys.argv[1], timeout=10) as c:
    out = c.infer("grow", {"x": np.array([1 << 20])})
    print("shape", out["y"].shape, int(out["y"].sum()))
"""


@needs_root
def test_a_client_of_another_user_than_its_worker_is_served_by_copies(nobody_dir):
    # Shared memory between processes of two users: the kernel opens /proc/<pid>/fd only for
    # the owner's user.  A root client of a service user's worker had its 1 MiB call fail
    # with "ProtocolError: cannot read inputs: ... permission denied (... this is a bug if
    # they do)", and a client of another user than a root worker the same for the worker's
    # outputs.  Now the worker answers NOT_LOCAL to inputs it may not open (the client sends
    # them again inline) and writes outputs inline for a client of another user.
    d, procs = nobody_dir
    rt = os.path.join(d, "rt")
    fe, be = f"ipc://{d}/fe.ipc", f"ipc://{d}/be.ipc"
    hb = ("--heartbeat-interval", "0.2")
    _start(procs, ["-m", "broker", "--frontend", fe, "--backend", be, *hb], nobody=True, rt=rt)
    echo = _start(procs, ["-m", "gpu_worker", "--broker", be, "--model", "echo", *hb, "--out-capacity-mb", "16"],
                  nobody=True, rt=rt)
    # 1. A root client (root's runtime directory, root's segments) of nobody's worker.
    x = np.arange(1 << 20, dtype=np.uint32)
    with Client(fe, timeout=10) as c:
        for _ in range(2):  # the second goes inline from the start (NOT_LOCAL remembered)
            out = c.infer("echo", {"x": x})
            assert np.array_equal(out["x"], x)
            out.release()
    echo.close()
    # 2. A client of nobody's (the broker's user) of a root worker, whose outputs it cannot open.
    _start(procs, ["-m", "gpu_worker", "--broker", be, "--model", "grow_model:factory", "--service", "grow", *hb,
                   "--out-capacity-mb", "16"], nobody=False, rt=rt)
    env = dict(os.environ, XDG_RUNTIME_DIR=rt, PYTHONPATH=str(ROOT))
    r = subprocess.run([*AS_NOBODY, sys.executable, "-c", NOBODY_CLIENT, fe], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["shape", f"({1 << 20},)", "0"], (r.stdout, r.stderr[-2000:])


FULL_CLIENT = """
import os, resource, sys
import numpy as np
from client_sdk import Client, DeadlineExceeded
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
c = Client(sys.argv[1], timeout=2)
import time
held = []
# The application uses up every descriptor left, and keeps taking those that come free
# until none has for 0.3 s: libzmq's reconnect attempts (every 100 ms; no broker yet) each
# hold one for a moment, and one held at the first "full" came free later and was served
# (a full run).  (Polling a condition, bounded: at most 10 s.)
last, give_up = time.monotonic(), time.monotonic() + 10
while time.monotonic() - last < 0.3 and time.monotonic() < give_up:
    try:
        held.append(os.open("/dev/null", os.O_RDONLY))
        last = time.monotonic()
    except OSError:
        time.sleep(0.001)  # (lets libzmq's I/O thread run on a loaded machine)
print("full", flush=True)
sys.stdin.readline()  # the broker is up now
try:
    c.infer("echo", {"x": np.zeros(3)})
    said = "served"
except DeadlineExceeded as e:
    said = str(e)
for fd in held:
    os.close(fd)
c.close()
print(said, flush=True)
"""


def test_a_client_out_of_descriptors_is_told_so_not_to_check_the_broker(cluster):
    # libzmq's I/O thread makes the connection and retries in silence when it gets EMFILE:
    # a client at its own RLIMIT_NOFILE waited out every call, told to check the broker's
    # endpoint and the broker's descriptor limit.
    p = subprocess.Popen([sys.executable, "-c", FULL_CLIENT, cluster.frontend], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        # (It writes nothing more until it reads "go": `communicate` below reads all the rest.)
        said = readline_within(p.stdout, 30, "the child's full (its descriptors used up)")
        assert said.strip() == "full", p.stderr.read()[-2000:] if p.poll() is not None else ""
        cluster.broker()  # the socket file appears only now: the client cannot have connected
        cluster.worker("echo")
        p.stdin.write("go\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err[-2000:]
    assert "this process has all of its 256 descriptors open (RLIMIT_NOFILE)" in out, (out, err[-2000:])
    assert "raise the limit" in out and "check that it is the broker's frontend" not in out, out


async def _async_call(endpoint: str, x) -> None:
    from client_sdk import AsyncClient

    async with AsyncClient(endpoint, insecure=True, timeout=2) as c:
        assert (await c.infer("echo", x))["x"].tolist() == [0, 1, 2]
        await _restarted.wait_for_it()  # the broker comes back with keys
        await c.infer("echo", x)


class _Restart:
    """The test's hook between a client's two calls (for the asyncio twin)."""

    def __init__(self):
        self.do = None

    async def wait_for_it(self):
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, self.do)


_restarted = _Restart()


@pytest.mark.parametrize("blocking", [True, False], ids=["Client", "AsyncClient"])
def test_a_broker_restarted_with_curvezmq_tells_its_plain_clients_why_it_refuses_them(tmp_path, blocking):
    # An operator turns CurveZMQ on and restarts the broker; clients that ran plain tcp
    # (insecure=True) stay up.  libzmq's handshake fails (one side CURVE, the other NULL)
    # and is tried again in silence: every call timed out advising "raise `timeout`, lower
    # the load, or add workers", as the client had heard from a broker at that address before.
    import asyncio

    from broker.security import make_keys
    from client_sdk import BrokerUnreachable, DeadlineExceeded

    make_keys(str(tmp_path / "keys"), "server")
    make_keys(str(tmp_path / "clients"), "alice")  # (the allow-list: some other client)
    hb = ("--heartbeat-interval", "0.2")
    be = f"ipc://{tmp_path}/be.ipc"
    procs: list[Proc] = []

    def broker(frontend, *security):
        p = Proc(["-m", "broker", "--frontend", frontend, "--backend", be, *hb, *security])
        procs.append(p)
        p.wait_ready()
        return p

    try:
        plain = broker("tcp://127.0.0.1:0", "--insecure")
        fe = plain.field("frontend")
        w = Proc(["-m", "gpu_worker", "--broker", be, "--model", "echo", *hb])
        procs.insert(0, w)
        w.wait_ready()

        def restart():
            plain.close()
            broker(fe, "--curve-secret", str(tmp_path / "keys" / "server.key_secret"),
                   "--client-keys", str(tmp_path / "clients"))

        x = {"x": np.arange(3)}
        with pytest.raises((DeadlineExceeded, BrokerUnreachable)) as info:  # (the refusal read, or not yet)
            if blocking:
                with Client(fe, insecure=True, timeout=2) as c:
                    assert c.infer("echo", x)["x"].tolist() == [0, 1, 2]
                    restart()
                    c.infer("echo", x)
            else:
                _restarted.do = restart
                asyncio.run(_async_call(fe, x))
        said = str(info.value)
        assert f"the broker at {fe} refuses this client's handshake: one side speaks CurveZMQ" in said, said
        assert "raise `timeout`" not in said, said
    finally:
        for p in procs:
            p.close()


def test_a_worker_whose_broker_came_back_on_another_backend_says_what_is_at_the_old_one(cluster):
    # The broker was started again with another --backend; a worker left on the old one said
    # only "broker silent for 0.6 s; reconnecting", once a minute, whatever the kernel said
    # of the endpoint it retried (libzmq retries an ipc connect in silence).
    old = cluster.broker()
    w = cluster.worker("echo")
    old.kill()  # SIGKILL: its socket file stays, with nothing listening on it
    moved = Proc(["-m", "broker", "--frontend", cluster.frontend, "--backend", f"ipc://{cluster.tmp}/be2.ipc",
                  "--heartbeat-interval", "0.2"])
    cluster.procs.append(moved)
    moved.wait_ready()
    w.wait_log(f"nothing listens on {cluster.tmp}/be.ipc (the broker that bound it is gone and left the file)",
               timeout=10)
