"""`free()` after `close()`: the error says that the client is closed (it used to say that the
array was not one `alloc()` returned, which it was).  No broker: the pool is the client's own."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client_sdk import AsyncClient, Client, InferenceError, InvalidInput
from client_sdk.core import ClientCore


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
