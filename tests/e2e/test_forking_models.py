"""Models that start processes (tests/e2e/forking_model.py): a `multiprocessing` pool, a
forked helper.  What a child forked from the worker does when it ends, or is told to end,
must not touch the worker, its broker or its clients: requests keep being served, the worker
stops on SIGTERM as always, and nothing is left behind (the leak fixture)."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from client_sdk import Client
from tests.e2e.conftest import wait_service


def _serve_three(c, service):
    for i in range(3):
        x = np.arange(4, dtype=np.float32) + i
        with c.infer(service, {"x": x}) as r:
            np.testing.assert_array_equal(r["y"], x + 1)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_model_that_runs_a_pool_in_each_call_is_served(cluster, method):
    # Found by the fork hunt: `with multiprocessing.Pool(2) as p: p.map(...)` in a model's
    # call hung the worker for good with the fork start method (Linux's default): the pool's
    # workers, forked from the worker, inherited its SIGTERM handler (a counter for the
    # worker's drain), so the SIGTERM that Pool.terminate() (its __exit__) sends them did
    # nothing, and the join waited forever: the request timed out, and the worker with it.
    cluster.broker()
    w = cluster.worker("forking_model:pool_call", env={"FORK_METHOD": method})
    with Client(cluster.frontend, timeout=15) as c:
        wait_service(c, "pool_call")
        _serve_three(c, "pool_call")
    assert w.p.poll() is None
    assert w.terminate() == 0, w.stderr()


def test_a_worker_whose_model_keeps_a_pool_stops_on_sigterm(cluster):
    # The same inheritance, at the worker's exit: multiprocessing terminates a pool's
    # daemonic workers (SIGTERM) and joins them; a pool made by the factory (fork) kept the
    # worker from exiting after its drain, until the launcher's SIGKILL.
    cluster.broker()
    w = cluster.worker("forking_model:pool_kept")
    with Client(cluster.frontend, timeout=15) as c:
        wait_service(c, "pool_kept")
        _serve_three(c, "pool_kept")
    assert w.terminate(timeout=10) == 0, w.stderr()


@pytest.mark.parametrize("how", ["fork", "popen"])
@pytest.mark.parametrize("thread", ["loop", "compute"])
def test_a_helper_the_model_starts_ends_on_sigterm(cluster, how, thread):
    # Found by the fork hunt: a helper the model started and stopped with SIGTERM (as
    # Popen.terminate() does) ran on.  Forked on the loop's thread, it kept the worker's
    # handler (a counter for a drain it does not run); started from the compute thread,
    # forked or exec'd, it inherited that thread's mask, SIGTERM blocked.
    cluster.broker()
    env = {"HOW": how, **({"SLOW": "1"} if thread == "compute" else {})}
    w = cluster.worker("forking_model:sigterm_child", env=env)
    with Client(cluster.frontend, timeout=15) as c:
        wait_service(c, "sigterm_child")
        for i in range(2):
            x = np.full(4, float(i), np.float32)
            with c.infer("sigterm_child", {"x": x}) as r:
                np.testing.assert_array_equal(r["y"], x + 1)
                assert bool(r["main"].reshape(-1)[0]) == (thread == "loop"), "the call ran on the other thread"
                status = int(r["status"].reshape(-1)[0])
                assert status != -1, f"a helper started by {how} on the {thread} thread ignored SIGTERM"
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
    assert w.p.poll() is None
    assert w.terminate() == 0, w.stderr()


@pytest.mark.parametrize("child", ["return", "exit"])
def test_a_child_forked_by_the_factory_ends_where_it_leaves_the_model(cluster, child):
    # Found by the fork hunt: a child the model's factory forked (or its warm-up, or a
    # keep-warm unit) that returned went on as a second worker (before, only a batch's
    # child ended there): it warmed up, printed its own READY and served as the worker,
    # while the worker itself waited for it in the factory and never served.
    cluster.broker()
    w = cluster.worker("forking_model:factory_fork", "--service", "factory_fork", env={"CHILD": child})
    assert int(w.field("pid")) == w.p.pid, f"READY came from {w.field('pid')}, not the worker (pid {w.p.pid})"
    with Client(cluster.frontend, timeout=15) as c:
        wait_service(c, "factory_fork")
        _serve_three(c, "factory_fork")
    assert w.terminate() == 0, w.stderr()


def test_a_helper_forked_in_a_call_does_not_hold_the_dead_workers_connection(cluster, tmp_path):
    # Found by the fork hunt: a helper the model forked during a batch kept the worker's
    # connection to its broker open after the worker was SIGKILLed, so the broker, which
    # hears a crash from the connection closing, waited out the worker's heartbeat
    # liveness (3 intervals) before it knew.  The child now closes its copies.  Heartbeats
    # of 10 s (30 s of liveness, the helper living 60 s) keep "at once" far from the
    # liveness window on a loaded machine.
    from tests.e2e.conftest import Proc

    pids = tmp_path / "helpers"
    b = Proc(["-m", "broker", "--frontend", cluster.frontend, "--backend", cluster.backend,
              "--heartbeat-interval", "10.0"])
    cluster.procs.append(b)
    b.wait_ready()
    w = cluster.worker("forking_model:helper_in_call", "--heartbeat-interval", "10.0",
                       env={"HELPER_PIDS": str(pids), "HELPER_S": "60"})
    try:
        with Client(cluster.frontend, timeout=15) as c:
            wait_service(c, "helper_in_call")
            with c.infer("helper_in_call", {"x": np.zeros(2, np.float32)}) as r:
                np.testing.assert_array_equal(r["x"], np.zeros(2, np.float32))
            w.kill()
            deadline = time.monotonic() + 10.0  # far under the 30 s of liveness
            while c.mmi_service("helper_in_call"):
                assert time.monotonic() < deadline, "the broker still counted the SIGKILLed worker alive"
                time.sleep(0.02)
    finally:
        for line in (pids.read_text().split() if pids.exists() else ()):
            try:
                os.kill(int(line), signal.SIGKILL)
            except ProcessLookupError:
                pass
