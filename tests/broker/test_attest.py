"""The broker's word for who made a client's ipc connection (broker/server.py `_fd_peer`):
the pid SO_PEERCRED gives and that process's start time, or nothing once it has exited.
The end-to-end attack (a connection outliving its maker, the pid reused) is
tests/e2e/test_descriptor_security.py; here the pieces, on a unix socket pair."""
from __future__ import annotations

import errno
import os
import socket

import pytest

from broker import server
from shm.segment import proc_starttime


def test_a_live_peer_is_its_pid_and_start_time():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert server._fd_peer(a.fileno()) == (os.getpid(), proc_starttime(os.getpid()))
        # Accepted after this process started: it may have made the connection.
        assert server._fd_peer(a.fileno(), server._boot_ticks()) == (os.getpid(), proc_starttime(os.getpid()))
    finally:
        a.close()
        b.close()


def test_a_process_started_after_the_connection_was_accepted_did_not_make_it():
    # Before Linux 6.5 (no SO_PEERPIDFD) the start time cannot be confirmed by a pidfd: a
    # pid reused by a process that started after the accept is told by the times alone.
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert server._fd_peer(a.fileno(), accepted=proc_starttime(os.getpid()) - 100) is None
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("err", [errno.ESRCH, errno.EINVAL, errno.ENODATA])
def test_every_way_the_kernel_says_the_peer_exited_is_no_attestation(monkeypatch, err):
    # ESRCH; EINVAL from Linux 6.5 to 6.15 for a reaped peer (review: taken for "no
    # SO_PEERPIDFD", it let a reused pid's start time through).
    real = socket.socket.getsockopt

    class Dup(socket.socket):
        def getsockopt(self, level, opt, *a):
            if opt == server.SO_PEERPIDFD:
                raise OSError(err, os.strerror(err))
            return real(self, level, opt, *a)

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    monkeypatch.setattr(server.wire, "dup_socket", lambda fd: Dup(fileno=os.dup(fd)))
    try:
        assert server._fd_peer(a.fileno()) is None
    finally:
        a.close()
        b.close()


_FIRST_ID = """
import sys, zmq
from broker.protocol import wire
if sys.argv[1] == "seed":
    wire.seed_routing_ids()
ctx = zmq.Context()
r = ctx.socket(zmq.ROUTER); r.linger = 0
port = r.bind_to_random_port("tcp://127.0.0.1")
d = ctx.socket(zmq.DEALER); d.linger = 0
d.connect(f"tcp://127.0.0.1:{port}")
d.send(b"x")
assert r.poll(10000)
print(r.recv_multipart()[0].hex())
"""


def test_the_routing_ids_libzmq_gives_peers_are_unpredictable():
    # libzmq 4.3 starts a ROUTER's own ids from the C library's rand(), never seeded: the
    # same ids in every process, so a peer could claim the next ones (the next ordinary
    # connection then aborted the broker on a duplicate id) or a dropped client's (and get
    # its replies): found by the CURVE hunt.  The broker and the worker seed it first.
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT

    def first(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", _FIRST_ID, mode], capture_output=True, text=True, cwd=ROOT,
                              timeout=60, check=True).stdout.strip()

    plain = {first("plain") for _ in range(2)}  # unseeded: the same id every time with libzmq 4.3.5
    seeded = {first("seed") for _ in range(3)}
    assert len(seeded) == 3 and not seeded & plain
