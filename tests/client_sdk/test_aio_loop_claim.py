"""One `AsyncClient`, one event loop, claimed once: two threads' loops whose first calls come at
the same moment must not both bind the client, and its reader never blocks the loop on its
socket.  Both had: the bind was a check of `_loop` and, after the readers were added, a set,
so both loops read the same DEALER, and the reader asked EVENTS and then received blocking,
so a loop whose message the other thread had taken hung in `recv` past every timeout (the
fork/threads hunt, t4_async_bind_race: 1 trial in 40-80).  No broker: the claim and the
reader are the client's own."""
from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from client_sdk import AsyncClient, InvalidInput

pytestmark = pytest.mark.timeout(30)

WAIT = 10.0  # bound of every blocking wait


class _PausingLoop(asyncio.SelectorEventLoop):
    """A loop whose first `add_reader` (the client binding it) says so (`inside`) and waits
    for `go` (at most WAIT) before it adds the reader: the window in which another loop's
    first call used to bind the client too.  (The loop's own self-pipe does not come here:
    asyncio adds it with `_add_reader`.)"""

    def __init__(self, inside: threading.Event, go: threading.Event):
        super().__init__()
        self._inside, self._go, self._paused = inside, go, False

    def add_reader(self, fd, callback, *args):
        if not self._paused:
            self._paused = True
            self._inside.set()
            self._go.wait(WAIT)
        return super().add_reader(fd, callback, *args)


def test_of_two_loops_whose_first_calls_come_at_once_one_gets_the_client(endpoint):
    c = AsyncClient(endpoint, timeout=WAIT, heartbeat_interval=None, direct_reply=False)
    inside, go = threading.Event(), threading.Event()
    own = _PausingLoop(inside, go)
    other: dict[str, str] = {}

    def second_loop() -> None:
        # Its first call comes while the first loop is binding the client.
        try:
            assert inside.wait(WAIT), "the first loop never started binding"
            asyncio.run(c.pump(0))
            other["outcome"] = "bound it too"
        except InvalidInput as e:
            other["outcome"] = str(e)
        finally:
            go.set()

    t = threading.Thread(target=second_loop)
    t.start()
    try:
        own.run_until_complete(c.pump(0))  # the first call: binds the client
        t.join(WAIT)
        assert not t.is_alive()
        assert "another event loop" in other["outcome"], other  # refused before it touched anything
        own.run_until_complete(c.pump(0))  # and the first loop keeps it
    finally:
        t.join(WAIT)
        own.run_until_complete(c.close())
        own.close()
    assert c.closed


class _Lying(zmq.Socket):
    """A DEALER whose EVENTS says a message is waiting when none is: what a reader finds when
    another thread took the message between its EVENTS and its receive.  A blocking receive
    would wait here (RCVTIMEO: for 2 s, then zmq.Again, which broke the client)."""

    def getsockopt(self, option, *args):
        value = super().getsockopt(option, *args)
        return value | zmq.POLLIN if option == zmq.EVENTS else value


def test_the_reader_never_waits_on_a_socket_that_has_nothing(endpoint):
    c = AsyncClient(endpoint, timeout=WAIT, heartbeat_interval=None, direct_reply=False)
    ctx = zmq.Context.instance()
    lying = _Lying(ctx, zmq.DEALER)
    lying.setsockopt(zmq.RCVTIMEO, 2000)
    lying.setsockopt(zmq.LINGER, 0)

    async def main() -> int:
        await c.pump(0)  # bound to this loop
        return c._drain(lying)  # what the loop's reader callback runs for a signalled socket

    try:
        assert asyncio.run(main()) == 0  # nothing read, at once
        assert not c._broken, c._broken  # and the client is not broken by it
    finally:
        lying.close()
        asyncio.run(c.close())
