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

from broker.protocol.header import _PLAIN_ITEMSIZE as _PLAIN
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
    """Their start is what a restart waits for: neither imports asyncio, and the broker, which never looks inside a
    tensor, not numpy either (`shm.names`), nor when it checks the tensors of the requests
    and replies it relays (`header._itemsize`): numpy loaded there would stall its loop
    once, and fail where no descriptor is left."""
    code = """
import sys, broker.__main__
from broker import protocol as P
from broker.protocol import header as H
def ref(dtype):
    return P.TensorRef("x", dtype, [2, 3], P.ShmLoc(segment="zinf-1-2-0123456789abcdef-5", offset=4096,
                                                     nbytes=6 * H._itemsize(dtype), slot=0, generation=1))
for dt in sorted(H._PLAIN_ITEMSIZE) + ["|S16", "<U4", "|V8"]:
    P.decode_request(P.encode_header(P.Request(id=1, host="h", tensors=[ref(dt)])), 0, routed=True)
    P.decode_reply(P.encode_header(P.Reply(id=1, tensors=[ref(dt)])), 0)
b = {'asyncio', 'numpy'} & set(sys.modules)
import gpu_worker.__main__
print(sorted(b), 'asyncio' in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] False", "a broker imports asyncio or numpy at start again, or a worker asyncio"


def test_a_blocking_client_loads_no_asyncio_and_the_asyncio_twin_is_there_at_first_use():
    """`client_sdk` loads its asyncio client at first use (PEP 562): a process with only
    blocking clients (a game server's) starts without asyncio; every public name is still
    there, in `dir()` and by `from client_sdk import *`."""
    code = """
import sys
import client_sdk
from client_sdk import Client, Stream, StreamStats, AsyncStream, Result, errors
b = 'asyncio' in sys.modules
names = set(dir(client_sdk))
from client_sdk import AsyncClient
from client_sdk.aio import AsyncClient as A, run
ns = {}
exec('from client_sdk import *', ns)
print(b, set(client_sdk.__all__) <= names, AsyncClient is A, client_sdk.run is run,
      set(client_sdk.__all__) <= set(ns), 'asyncio' in sys.modules)
try:
    client_sdk.NoSuchName
except AttributeError as e:
    print('AttributeError', e)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert first == "False True True True True True", first
    assert second == "AttributeError module 'client_sdk' has no attribute 'NoSuchName'"


SIZED = ["|S1", "|S16", "|S99999999", "|V1", "|V8", "<U1", ">U4", "<U99999999"]
REFUSED = ["<S16", "|U4", "|S0", "|V0", "<U0", "|S016", "S16", "<f3", "|f4", "<b1", "=f4", "|S999999999"]


@pytest.mark.parametrize("dtype", sorted(_PLAIN) + SIZED + REFUSED + ["<M8[ns]", "<m8[s]", "|O"])
def test_the_item_sizes_told_without_numpy_are_numpys(dtype):
    """`_itemsize` answers as `parse_dtype` does: the same size, or the same refusal."""
    from broker.protocol.header import ProtocolError, _itemsize, parse_dtype

    try:
        want = parse_dtype(dtype).itemsize
    except ProtocolError as e:
        with pytest.raises(ProtocolError) as got:
            _itemsize(dtype)
        assert str(got.value) == str(e)
    else:
        assert _itemsize(dtype) == want


def test_a_broker_that_cannot_load_numpy_answers_an_uncommon_dtype_503():
    """A broker loads numpy at its first uncommon dtype (a datetime): where that import fails
    (no descriptor or memory left) the request is answered 503, not dropped as malformed,
    and the common dtypes are checked as before."""
    code = """
import builtins, sys
from broker.protocol import header as H
real = builtins.__import__
def refuse(name, *a, **k):
    if name == "numpy" or name.startswith("numpy."):
        raise OSError(24, "Too many open files")
    return real(name, *a, **k)
builtins.__import__ = refuse
try:
    H.parse_dtype("<M8[ns]")
except H.ProtocolError as e:
    print(int(e.code), "send it again" in str(e), H._itemsize("<f4"), "numpy" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["503", "True", "4", "False"], out.stdout
