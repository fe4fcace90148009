"""client_sdk.sockets.ipc_problem and IpcDiagnosis: what a call that never heard from its
ipc broker says, and how often it looks (review: every timed-out call connected to the
socket, 200 connections for 200 calls)."""
from __future__ import annotations

import os
import socket

from client_sdk import sockets


def test_a_broker_near_its_descriptor_limit_is_told_apart_from_none(tmp_path):
    path = tmp_path / "fe.ipc"
    assert "no broker is bound there" in sockets.ipc_problem(f"ipc://{path}")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(f"{path}.{os.getpid()}.paused")  # broker.protocol.limits.move_aside's name, a live owner
        assert "takes no new clients now: it is near its descriptor limit" in sockets.ipc_problem(f"ipc://{path}")
    os.rename(f"{path}.{os.getpid()}.paused", f"{path}.999999999.paused")  # its broker gone (SIGKILLed paused)
    assert "no broker is bound there" in sockets.ipc_problem(f"ipc://{path}")
    assert sockets.ipc_problem("tcp://127.0.0.1:5555") is None
    assert sockets.ipc_problem("ipc://@abstract") is None


def test_the_diagnosis_looks_once_a_second_at_most(tmp_path, monkeypatch):
    looks = []
    monkeypatch.setattr(sockets, "ipc_problem", lambda ep: looks.append(ep) or "why")
    clock = [100.0]
    monkeypatch.setattr(sockets.time, "monotonic", lambda: clock[0])
    ask = sockets.IpcDiagnosis("ipc:///x.ipc")
    assert [ask() for _ in range(200)] == ["why"] * 200 and len(looks) == 1
    clock[0] += 1.0
    assert ask() == "why" and len(looks) == 2
