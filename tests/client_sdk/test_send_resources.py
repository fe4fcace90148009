"""A request that this process cannot send, for want of memory, descriptors or threads: a
typed `InferenceError` that says so, the call forgotten (nothing in flight), and the socket
left at a message boundary, so the next request is a message of its own and is answered.

Before, the call raised the raw exception (MemoryError, OSError, ZMQError, RuntimeError), or
in the AsyncClient it was only logged, and the request's unfinished message took the
client's next message with it: refused by the broker as one malformed request, that call
waited out its timeout.  The request's large inline frame cannot be sent here even copied
(`wire._send` refuses it): `wire.send_frames` then ends the message and raises
(tests/broker/test_wire_resources.py); what it does when only pyzmq's zero-copy machinery is
missing (the frame goes copied, nothing raised) is tested there and with real processes in
tests/e2e/test_wire_resources.py."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import zmq

from broker.protocol import wire
from client_sdk import AsyncClient, Client, InferenceError

from .test_sdk_client import WAIT

BIG = np.arange(1 << 17, dtype=np.uint8)  # 128 KiB inline: the request's last frame


def _starve(monkeypatch) -> None:
    real = wire._send

    def starved(sock, f, flags, copy):
        if memoryview(f).nbytes >= zmq.COPY_THRESHOLD:
            raise MemoryError  # no memory for this frame, zero-copy or copied
        return real(sock, f, flags, copy)

    monkeypatch.setattr(wire, "_send", starved)


def _received(fake) -> list[str]:
    return fake.call(lambda: [service for service, _ in fake.requests])


def test_a_request_the_process_cannot_send_is_a_typed_error_and_the_next_one_is_answered(fake, endpoint, monkeypatch):
    with Client(endpoint, transport="inline", timeout=WAIT) as c:
        for how in ("infer", "infer_stream"):
            _starve(monkeypatch)
            with pytest.raises(InferenceError, match="out of descriptors, memory or threads") as info:
                if how == "infer":
                    c.infer("echo", {"x": BIG})
                else:
                    c.infer_stream("echo", {"x": BIG})
            assert type(info.value) is InferenceError and "(MemoryError)" in str(info.value)
            assert c.in_flight() == 0  # forgotten: nothing waits for an answer to it
            monkeypatch.undo()
            with c.infer("echo", {"x": np.arange(10)}) as r:
                assert r["x"][9] == 9
    # The broken request ended malformed (refused: never a request); the next ones came whole.
    assert _received(fake) == ["echo", "echo"]


def test_an_async_request_the_process_cannot_send_is_a_typed_error_and_the_next_one_is_answered(fake, endpoint,
                                                                                                  monkeypatch):
    async def main():
        async with AsyncClient(endpoint, transport="inline", timeout=WAIT) as c:
            for how in ("infer", "infer_stream"):
                _starve(monkeypatch)
                with pytest.raises(InferenceError, match="out of descriptors, memory or threads") as info:
                    if how == "infer":
                        await c.infer("echo", {"x": BIG})
                    else:
                        c.infer_stream("echo", {"x": BIG})
                assert type(info.value) is InferenceError and "(MemoryError)" in str(info.value)
                assert c.in_flight() == 0
                monkeypatch.undo()
                r = await c.infer("echo", {"x": np.arange(10)})
                assert r["x"][9] == 9
                r.release()

    asyncio.run(main())
    assert _received(fake) == ["echo", "echo"]
