"""Models that start processes the way real ones do, each computing y = x + 1 elsewhere and
sending it back.  Loaded as `--model forking_model:NAME`, with this folder on PYTHONPATH.

- `pool_call`: a `multiprocessing` pool made, used and closed in every call (`with
  Pool(2) as p: p.map(...)`, whose `__exit__` terminates the pool: SIGTERM to its workers);
  the start method is $FORK_METHOD (default: the platform's, fork on Linux).
- `pool_kept`: one pool made by the factory and kept for the worker's life (its daemonic
  workers are terminated by multiprocessing at the worker's exit).
- `factory_fork`: the factory forks a child that returns (or `sys.exit()`s).
- `sigterm_child`: a helper (`os.fork()` or `subprocess`) that waits, stopped with SIGTERM:
  it must end by that signal.
"""
import multiprocessing
import os
import signal
import subprocess
import threading
import time

import numpy as np

from gpu_worker.models import ModelBase


def _plus_one(row):
    return row + 1


def _ctx():
    return multiprocessing.get_context(os.environ.get("FORK_METHOD") or None)


class _Base(ModelBase):
    framework = "numpy"
    batchable = False

    def __init__(self, device="cpu"):
        self.device = device

    def example_inputs(self):
        return {"x": np.zeros(4, np.float32)}


class PoolCall(_Base):
    name = "pool_call"

    def __call__(self, batch):
        x = np.asarray(batch["x"])
        with _ctx().Pool(2) as p:
            rows = p.map(_plus_one, list(x[0]))
        return {"y": np.asarray(rows, x.dtype)[None]}


class PoolKept(_Base):
    name = "pool_kept"

    def __init__(self, device="cpu"):
        super().__init__(device)
        self.pool = _ctx().Pool(2)

    def __call__(self, batch):
        x = np.asarray(batch["x"])
        return {"y": np.asarray(self.pool.map(_plus_one, list(x[0])), x.dtype)[None]}


class SigtermChild(_Base):
    """Starts a helper that waits (for work, or a signal) and stops it with SIGTERM, as
    `Popen.terminate()` does: $HOW says how, "fork" (`os.fork()`) or "popen" (`sleep 30`
    through `subprocess`); with $SLOW set each call takes 0.2 s more, so that the worker
    runs it on its compute thread (a call timed under half a heartbeat runs on the loop's).
    Returns the helper's wait status (-1: SIGTERM did not end it within 3 s) and whether
    the call ran on the main thread."""

    name = "sigterm_child"

    def __call__(self, batch):
        x = np.asarray(batch["x"])
        if os.environ.get("SLOW"):
            time.sleep(0.2)
        if os.environ.get("HOW", "fork") == "popen":
            pid = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL).pid
        else:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(r)
                    os.write(w, b"up")
                    while True:
                        time.sleep(0.05)  # a helper waiting for work (or a signal)
                finally:
                    os._exit(3)  # reached only if the signal was turned into an exception
            os.close(w)
            os.read(r, 2)  # the child is up (its handlers are what it inherited)
            os.close(r)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:  # it ignored SIGTERM: end it, and say so
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = -1
                break
            time.sleep(0.01)
        return {"y": x + 1, "status": np.array([[status]], np.int64),
                "main": np.array([[threading.current_thread() is threading.main_thread()]])}


def pool_call(device="cpu"):
    return PoolCall(device)


def pool_kept(device="cpu"):
    return PoolKept(device)


def sigterm_child(device="cpu"):
    return SigtermChild(device)


def factory_fork(device="cpu"):
    """Forks in the factory, as a model that starts a helper while it loads; the child
    leaves as $CHILD says: "return" (returns the model to the factory's caller, the
    mistake), "exit" (`sys.exit(0)`).  The parent waits for it, then loads as usual."""
    import sys

    pid = os.fork()
    if pid == 0:
        if os.environ.get("CHILD") == "exit":
            sys.exit(0)
        return PoolKept(device)  # the child's copy of the worker goes on from here
    os.waitpid(pid, 0)
    return PoolKept(device)


def helper_in_call(device="cpu"):
    """Forks, in its first call, a helper that lives on (up to $HELPER_S seconds, then
    `os._exit`), as a model that starts a server process lazily; its pid goes to
    $HELPER_PIDS.  Returns its inputs."""
    started = []

    def helper_in_call(batch):
        if not started:
            started.append(1)
            pid = os.fork()
            if pid == 0:
                try:
                    time.sleep(float(os.environ.get("HELPER_S", "10")))
                finally:
                    os._exit(0)
            with open(os.environ["HELPER_PIDS"], "a") as f:
                f.write(f"{pid}\n")
        return dict(batch)

    return helper_in_call
