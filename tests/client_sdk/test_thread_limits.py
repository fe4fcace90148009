"""A client made in a process that cannot start threads (a pids cgroup at its limit,
RLIMIT_NPROC): libzmq starts two at the context's first socket and aborts the whole process
when it cannot, so the first client of a process first sees that threads can start, and
raises `InferenceError` when they cannot; a later client asks again (a refusal is not kept),
and once it succeeded no client asks again in that process.  The real limit, with a real
abort before: tests/e2e/test_wire_resources.py (root and a pids cgroup)."""
from __future__ import annotations

import threading

import pytest

from client_sdk import Client, InferenceError, sockets


@pytest.fixture
def no_thread(monkeypatch):
    """Thread.start refused, as the kernel refuses it at a pids limit; `allow()` lifts it."""
    real = threading.Thread.start
    tries: list[str] = []  # the names of the threads asked for
    limit = {"on": True}

    def start(self):
        tries.append(self.name)
        if limit["on"]:
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(sockets, "_checked_in", None)  # as in a process with no client yet
    monkeypatch.setattr(threading.Thread, "start", start)

    class Limit:
        probes = staticmethod(lambda: sum(1 for name in tries if name == "client-sdk-thread-room"))

        @staticmethod
        def allow():
            limit["on"] = False

    return Limit


def test_the_first_client_of_a_process_that_cannot_start_threads_is_refused(no_thread, tmp_path):
    with pytest.raises(InferenceError, match="cannot start threads"):
        Client(f"ipc://{tmp_path}/nobody.ipc", timeout=1)
    assert no_thread.probes() == 1  # it asked
    with pytest.raises(InferenceError, match="cannot start threads"):
        Client(f"ipc://{tmp_path}/nobody.ipc", timeout=1)
    assert no_thread.probes() == 2  # and asks again
    no_thread.allow()
    c = Client(f"ipc://{tmp_path}/nobody.ipc", timeout=1)
    c.close()
    asked = no_thread.probes()
    assert asked >= 2 + sockets._ZMQ_THREADS
    assert not [t for t in threading.enumerate() if t.name == "client-sdk-thread-room"]  # joined
    c = Client(f"ipc://{tmp_path}/nobody.ipc", timeout=1)  # asked once per process
    c.close()
    assert no_thread.probes() == asked
