"""`free()` and `stream()` after `close()`: the error says that the client is closed (`free()`
used to say that the array was not one `alloc()` returned, which it was; `stream()` returned
a stream that failed at its first send).  No broker: the pool is the client's own."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client_sdk import AsyncClient, Client, InferenceError, InvalidInput
from client_sdk.core import ClientCore
from tests.alarms import alarm


def test_core_free_after_close_says_closed(tmp_path):
    core = ClientCore(f"ipc://{tmp_path}/b.sock", transport="shm")
    a = core.alloc((4,), np.float32)
    core.close()
    with pytest.raises(InferenceError, match="closed") as info:
        core.free(a)
    assert not isinstance(info.value, InvalidInput)


def test_client_free_after_close_says_closed(tmp_path):
    c = Client(f"ipc://{tmp_path}/b.sock", transport="shm", heartbeat_interval=None)
    try:
        a = c.alloc((4,), np.float32)
        b = c.alloc((4,), np.float32)
        c.free(b)
        with pytest.raises(InvalidInput, match="not freed yet"):  # still the error for a wrong array
            c.free(b)
    finally:
        c.close()
    with pytest.raises(InferenceError, match="closed") as info:
        c.free(a)
    assert not isinstance(info.value, InvalidInput)


def test_async_client_free_after_close_says_closed(tmp_path):
    async def main():
        c = AsyncClient(f"ipc://{tmp_path}/b.sock", transport="shm", heartbeat_interval=None)
        try:
            a = c.alloc((4,), np.float32)
        finally:
            await c.close()
        with pytest.raises(InferenceError, match="closed") as info:
            c.free(a)
        assert not isinstance(info.value, InvalidInput)

    asyncio.run(main())


def test_stream_after_close_says_closed(tmp_path):
    """`stream()` on a closed client returned a stream whose first `send()` raised; its twin
    `infer_stream()` raised at once (found by the docs hunt).  Both raise now, on both twins."""
    c = Client(f"ipc://{tmp_path}/b.sock", heartbeat_interval=None)
    c.close()
    with pytest.raises(InferenceError, match="closed"):
        c.stream("echo")

    async def main():
        a = AsyncClient(f"ipc://{tmp_path}/b.sock", heartbeat_interval=None)
        await a.close()
        with pytest.raises(InferenceError, match="closed"):
            a.stream("echo")

    asyncio.run(main())


@pytest.mark.parametrize("where", ["send", "submit"])
def test_close_from_a_signal_handler_ends_a_call_waiting_for_the_socket_to_take_it(tmp_path, where):
    """The broker does not read (nobody at the endpoint: the DEALER's queue fills): a call
    waits for the socket to take its message.  A signal handler's close() ended it only at
    its timeout (`infer`, 6 s) or never (`submit` with no timeout: a stream's recv); found by
    review.  It ends at once now."""
    import time

    c = Client(f"ipc://{tmp_path}/nobody.sock", timeout=6.0, heartbeat_interval=None, transport="inline",
               direct_reply=False)
    x = {"x": np.zeros(4, np.float32)}
    while True:  # fill the socket's queue
        call = c.prepare("echo", x)
        if not c.submit(call, timeout=0):
            c.give_up(call)
            break
    closed_at = []

    def handler(signum, frame):
        c.close()
        closed_at.append(time.monotonic())

    try:
        with alarm(handler, 0.2):  # the stimulus: a signal while the call waits (pytest-timeout's kept)
            with pytest.raises(InferenceError, match="closed while this call was waiting"):
                if where == "send":
                    c.infer("echo", x)
                else:
                    c.submit(c.prepare("echo", x), timeout=None)
        assert closed_at and time.monotonic() - closed_at[0] < 1.0
    finally:
        c.close()
