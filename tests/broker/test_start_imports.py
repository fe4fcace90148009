"""`broker.protocol.wire.monitor_event`: a socket monitor's events read as pyzmq reads them,
without `zmq.utils.monitor` (which imports asyncio: 20-50 ms of every broker's, worker's and
blocking client's start); and what a broker and a worker import to start."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from broker.protocol.wire import monitor_event, recv_monitor_event

ROOT = Path(__file__).resolve().parents[2]


def test_events_read_as_pyzmq_reads_them(tmp_path):
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    client = ctx.socket(zmq.DEALER)
    server.linger = client.linger = 0
    try:
        mon = server.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_LISTENING)
        endpoint = f"ipc://{tmp_path}/s.ipc"
        server.bind(endpoint)
        client.connect(endpoint)
        seen = []
        while len(seen) < 3:
            assert mon.poll(10_000), f"only {seen} within 10 s"
            frames = mon.recv_multipart()
            ours, theirs = monitor_event(frames), parse_monitor_message(frames)
            assert ours == {k: (int(v) if k != "endpoint" else v) for k, v in theirs.items()}
            assert type(ours["event"]) is int and ours["endpoint"] == endpoint.encode()
            seen.append(ours["event"])
            if ours["event"] == zmq.EVENT_ACCEPTED:
                assert ours["value"] >= 0  # the accepted connection's descriptor
                client.close(0)
        assert seen == [zmq.EVENT_LISTENING, zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED]
        server.disable_monitor()
        mon.close(0)
    finally:
        client.close(0)
        server.close(0)
        ctx.term()


def test_recv_monitor_event_reads_one_from_the_socket(tmp_path):
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://m")
        b.connect("inproc://m")
        a.send_multipart([(0x0200).to_bytes(2, "little") + (7).to_bytes(4, "little"), b"tcp://x:1"])
        assert b.poll(10_000)
        assert recv_monitor_event(b) == {"event": 0x0200, "value": 7, "endpoint": b"tcp://x:1"}
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


@pytest.mark.parametrize("frames", [[], [b"\0" * 6], [b"\0" * 5, b"e"], [b"\0" * 6, b"e", b"x"]])
def test_anything_else_is_a_value_error(frames):
    with pytest.raises(ValueError, match="monitor"):
        monitor_event(frames)


def test_a_broker_and_a_worker_start_without_asyncio_and_a_broker_without_numpy():
    """Their start is what a restart waits for: neither imports asyncio (`client_sdk`'s
    package does, for its asyncio client), and the broker, which never looks inside a
    tensor, not numpy either (`shm.names`, and `parse_dtype`'s import)."""
    code = ("import sys, broker.__main__; b = {'asyncio', 'numpy'} & set(sys.modules); "
            "import gpu_worker.__main__; print(sorted(b), 'asyncio' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] False", "a broker imports asyncio or numpy at start again, or a worker asyncio"
