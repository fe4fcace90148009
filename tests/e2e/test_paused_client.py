"""A client stopped (SIGSTOP: a debugger, a frozen container, a laptop lid) while its call's
result comes, and continued after the call's deadline: the result is in its sockets, and the
call returns it, with `Client` and with `AsyncClient` on uvloop and on plain asyncio.  It
used to be a race of threads: the caller's thread woke at its deadline before libzmq's I/O
thread (stopped too) had handed the reply on, and raised DeadlineExceeded (the asyncio
client then counted the result stray).  Real processes; the pause is the stimulus, every
wait for an outcome is a condition with a timeout."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.children import readline_within

from .conftest import ROOT
from .test_metrics import scrape, until, value

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 1.0

CHILD = """
import asyncio, sys
import numpy as np
from client_sdk import AsyncClient, Client, run
ep, kind, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
x = np.arange(8, dtype=np.float32)

def say(r):
    print("result", r["x"].tolist() == x.tolist(), flush=True)

if kind == "sync":
    with Client(ep, timeout=10) as c:
        assert c.mmi_service("gate")
        print("ready", flush=True)
        try:
            say(c.infer("gate", {"x": x}, timeout=timeout))
        except Exception as e:
            print("error", type(e).__name__, flush=True)
else:
    async def main():
        async with AsyncClient(ep, timeout=10) as c:
            assert await c.mmi_service("gate")
            print("ready", flush=True)
            try:
                say(await c.infer("gate", {"x": x}, timeout=timeout))
            except Exception as e:
                print("error", type(e).__name__, flush=True)
    run(main()) if kind == "uvloop" else asyncio.run(main())
"""


@pytest.mark.parametrize("kind", ["sync", "uvloop", "asyncio"])
def test_a_client_stopped_past_its_deadline_while_the_result_came_returns_it(cluster, gate, kind):
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    worker = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--no-warmup",
                            env=gate.env, wait=False)
    gate.open()
    worker.wait_ready()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", CHILD, cluster.frontend, kind, str(TIMEOUT)],
                             stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert readline_within(child.stdout, 30, "the child's ready (its client up)").strip() == "ready"
        start = time.monotonic()

        def held() -> bool:
            return value(scrape(base), "zmq_infer_in_flight", service="gate") == 1

        until(held, "the request at the worker")
        os.kill(child.pid, signal.SIGSTOP)
        gate.release()  # the worker answers the stopped client straight (shared memory)
        until(lambda: not held(), "the worker's DONE")
        time.sleep(max(0.0, start + TIMEOUT + 0.3 - time.monotonic()))  # the stimulus: past the deadline
        os.kill(child.pid, signal.SIGCONT)
        assert readline_within(child.stdout, 30, "the continued child's result").split() == ["result", "True"]
        assert child.wait(10) == 0
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait(10)
        child.stdout.close()
