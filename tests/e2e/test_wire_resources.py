"""Processes out of descriptors or threads at a send, or at a client's creation, with real
processes (docs/client.md, "Errors"; broker.protocol.wire.send_frames).

A frame of 64 KiB or more is sent zero-copy, and pyzmq starts what that needs (its
garbage-collector thread, that thread's own context with two I/O threads, a few descriptors,
its module) at the first such frame of the process.  A process out of descriptors or threads
at that moment had that frame fail after the message's first frames had gone out: the
message was left open, and the socket's next message was glued onto it.  A client raised a
raw OSError or RuntimeError and its next, innocent request was lost (the broker refused the
two as one malformed request: the call waited out its timeout); a worker's error reply was
appended to the broken reply (the client saw a ProtocolError).  And a client made in a
process that could not start threads took the whole process down (libzmq aborts when its
I/O threads cannot start).

Each case runs in a process of its own (a fresh pyzmq, whose zero-copy machinery has not
started yet): descriptors are taken up to RLIMIT_NOFILE by the process itself, and threads
are refused by a pids cgroup set to the number the process has (root and a pids controller,
else skipped; `pids_cgroup` removes it).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from client_sdk import Client
from tests.e2e.conftest import ROOT, wait_service
from tests.e2e.test_launcher import pids_cgroup  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(90)

_ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}

# The big tensor is the request's last frame: a frame that failed there left the message
# open for good, and the next request was glued onto it.
_OUT_OF_DESCRIPTORS = """
import asyncio, os, resource, sys
import numpy as np
from client_sdk import AsyncClient, Client

endpoint, twin = sys.argv[1], sys.argv[2]
big = np.arange(1 << 17, dtype=np.uint8)  # 128 KiB: sent zero-copy


def starve():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    return soft, hard, held


def feed(soft, hard, held):
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


if twin == "sync":
    c = Client(endpoint, timeout=10, transport="inline", direct_reply=False)
    assert c.mmi_service("echo")
    held = starve()
    try:
        with c.infer("echo", {"x": big}) as r:
            print("at the limit:", bool(np.array_equal(r["x"], big)), flush=True)
    finally:
        feed(*held)
    for i in range(3):
        with c.infer("echo", {"x": np.arange(10)}) as r:
            assert r["x"][9] == 9
    print("then: ok", c.in_flight(), flush=True)
    c.close()
else:
    async def main():
        async with AsyncClient(endpoint, timeout=10, transport="inline", direct_reply=False) as c:
            assert await c.mmi_service("echo")
            held = starve()
            try:
                r = await c.infer("echo", {"x": big})
                print("at the limit:", bool(np.array_equal(r["x"], big)), flush=True)
                r.release()
            finally:
                feed(*held)
            for i in range(3):
                r = await c.infer("echo", {"x": np.arange(10)})
                assert r["x"][9] == 9
                r.release()
            print("then: ok", c.in_flight(), flush=True)

    asyncio.run(main())
"""


def _run(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=_ENV, timeout=timeout,
                          capture_output=True, text=True)


def test_a_client_out_of_descriptors_at_its_first_large_inline_tensor_sends_it_and_the_next_ones(cluster):
    # Before: the large tensor raised a raw OSError (pyzmq's garbage-collector module could
    # not even be imported), and the next request was glued onto the open message: refused
    # by the broker as one malformed request, that call waited out its timeout (the
    # AsyncClient only logged the error, and its own call waited too).
    cluster.broker()
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
    for twin in ("sync", "async"):
        p = _run(_OUT_OF_DESCRIPTORS, cluster.frontend, twin)
        assert p.returncode == 0 and p.stdout.splitlines() == ["at the limit: True", "then: ok 0"], \
            (twin, p.returncode, p.stdout, p.stderr[-3000:])


def _limit(cgroup: str, value: str) -> None:
    with open(f"{cgroup}/pids.max", "w") as f:
        f.write(value)


def _current(cgroup: str) -> str:
    with open(f"{cgroup}/pids.current") as f:
        return f.read().strip()


_JOIN = """
def join_at_its_limit(cgroup):
    # This process in the cgroup, which then takes no new task (thread) until lifted.
    with open(cgroup + "/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    with open(cgroup + "/pids.current") as f:
        now = f.read().strip()
    with open(cgroup + "/pids.max", "w") as f:
        f.write(now)


def lift(cgroup):
    with open(cgroup + "/pids.max", "w") as f:
        f.write("max")
"""

_MADE_WITHOUT_THREADS = """
import os, sys
from client_sdk import AsyncClient, Client, InferenceError
""" + _JOIN + """
cgroup, endpoint = sys.argv[1], sys.argv[2]
join_at_its_limit(cgroup)
for twin in (Client, AsyncClient):
    try:
        c = twin(endpoint, timeout=1)
    except InferenceError as e:
        print(twin.__name__, "refused:", type(e).__name__, "cannot start threads" in str(e), flush=True)
    else:
        print(twin.__name__, "made", flush=True)
lift(cgroup)
c = Client(endpoint, timeout=1)  # threads again: made (the refusal was not kept)
c.close()
print("then: made", flush=True)
"""


def test_a_client_made_where_no_thread_can_start_is_refused_and_the_process_lives(tmp_path, pids_cgroup):  # noqa: F811
    # Before: libzmq could not start its I/O threads at the client's first socket and aborted
    # the whole process ("Resource temporarily unavailable (src/thread.cpp:241)", SIGABRT).
    p = _run(_MADE_WITHOUT_THREADS, pids_cgroup, f"ipc://{tmp_path}/nobody.ipc")
    assert p.returncode == 0 and p.stdout.splitlines() == [
        "Client refused: InferenceError True", "AsyncClient refused: InferenceError True", "then: made"], \
        (p.returncode, p.stdout, p.stderr[-3000:])


_OUT_OF_THREADS = """
import os, sys
import numpy as np
from client_sdk import Client
""" + _JOIN + """
cgroup, endpoint = sys.argv[1], sys.argv[2]
c = Client(endpoint, timeout=10, transport="inline", direct_reply=False)
with c.infer("echo", {"x": np.arange(10)}) as r:  # connected, and answered once
    pass
big = np.arange(1 << 17, dtype=np.uint8)
join_at_its_limit(cgroup)
try:
    with c.infer("echo", {"x": big}) as r:
        print("at the limit:", bool(np.array_equal(r["x"], big)), flush=True)
finally:
    lift(cgroup)
for i in range(3):
    with c.infer("echo", {"x": np.arange(10)}) as r:
        assert r["x"][9] == 9
print("then: ok", c.in_flight(), flush=True)
c.close()
"""


def test_a_client_out_of_threads_at_its_first_large_inline_tensor_sends_it_and_the_next_ones(
        pids_cgroup, cluster):  # noqa: F811
    # Before: pyzmq could not start its garbage-collector thread for the zero-copy frame (a
    # raw RuntimeError "can't start new thread"), and the next request was glued onto the
    # message left open.
    cluster.broker()
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
    p = _run(_OUT_OF_THREADS, pids_cgroup, cluster.frontend)
    assert p.returncode == 0 and p.stdout.splitlines() == ["at the limit: True", "then: ok 0"], \
        (p.returncode, p.stdout, p.stderr[-3000:])


def test_a_worker_out_of_threads_at_its_first_large_inline_reply_sends_it_whole(pids_cgroup, cluster):  # noqa: F811
    # Before: the worker's first reply of 64 KiB or more sent inline could not start pyzmq's
    # garbage-collector thread, and its error reply was appended to the broken reply: the
    # client got a ProtocolError for a request that had run.  Now what that needs is started
    # with the worker, and a reply whose zero-copy frame cannot be made is sent copied.
    cluster.broker()
    worker = cluster.worker("echo", prefix=["sh", "-c", f'echo $$ > {pids_cgroup}/cgroup.procs && exec "$@"', "sh"])
    big = np.arange(1 << 17, dtype=np.uint8)
    with Client(cluster.frontend, timeout=10, transport="inline") as c:
        wait_service(c, "echo")
        with c.infer("echo", {"x": np.arange(10)}, reply="inline") as r:  # connected, and answered once
            assert r["x"][9] == 9
        _limit(pids_cgroup, _current(pids_cgroup))
        try:
            for _ in range(2):
                with c.infer("echo", {"x": big}, reply="inline") as r:
                    np.testing.assert_array_equal(r["x"], big)
        finally:
            _limit(pids_cgroup, "max")
        with c.infer("echo", {"x": big}, reply="inline") as r:
            np.testing.assert_array_equal(r["x"], big)
    assert worker.p.poll() is None
