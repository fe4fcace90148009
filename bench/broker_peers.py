"""Our broker as bench peers: `broker-shm` (inputs written once into shared memory and sent
by reference) and `broker-inline` (the same request with its bytes inline in the message,
as a remote client would send it).  Both run `python -m broker` and one
`python -m gpu_worker --model echo`, and talk through `client_sdk.AsyncClient`.

The shared-memory peer copies each distinct payload into the client's pool once, the first
time it sees it, and sends that buffer on every request: an application writes its tensor
into shared memory once (a camera ring, a preprocessing output) and the transport must not
copy it again.  The echo worker hands the input back by reference, so nothing on the path
copies the payload.

`proxy-sdk` is the floor these are held to: the same client code and the same
`gpu_worker` echo (run by `bench.proxied_worker`), with the broker replaced by a libzmq
proxy process (`zmq.proxy`, no Python in the relay).
"""
from __future__ import annotations

import asyncio

import os
from typing import Any

import numpy as np

from bench.peers import Peer, PeerClient, PeerStartError, register


class _BrokerClient(PeerClient):
    def __init__(self, endpoint: str, transport: str, pin: bool = False):
        from client_sdk import AsyncClient, Client

        self.transport = transport
        self.pin = pin
        # A remote client gets its outputs inline too; a local one where the worker chooses.
        self.reply = "inline" if transport == "inline" else "auto"
        self._aio = AsyncClient(endpoint, transport=transport, timeout=60, pin=pin)
        self._sync: Any = None
        self._endpoint = endpoint
        self._Client = Client
        # (id(SDK client), id(payload)) -> (payload, its copy in that client's pool): the
        # asyncio and the blocking client each have a pool of their own, and a buffer from
        # the other's would be copied on every request.
        self._staged: dict[tuple[int, int], tuple[Any, np.ndarray]] = {}
        self._last: Any = None  # the blocking client's previous Result, released at the next call

    def _stage(self, client, payload) -> np.ndarray:
        arr = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, np.uint8)
        if self.transport != "shm":
            return arr
        key = (id(client), id(payload))
        hit = self._staged.get(key)
        if hit is not None and hit[0] is payload and hit[1].base is not None:
            return hit[1]
        buf = client.alloc(arr.shape, arr.dtype)
        np.copyto(buf, arr)
        self._staged[key] = (payload, buf)
        return buf

    @staticmethod
    def _timing(res) -> dict:
        t = res.timing
        out = {}
        for key in ("queue_ms", "input_ms", "compute_ms", "output_ms"):
            if key in t:
                out[key] = t[key]
        if "batch_wait_ms" in t:
            out["queue_ms"] = out.get("queue_ms", 0.0) + t["batch_wait_ms"]
        return out

    async def request(self, payload: Any) -> dict | None:
        x = self._stage(self._aio, payload)
        before = self._aio.pinned_replies if self.pin else 0
        res = await self._aio.infer("echo", {"x": x}, reply=self.reply)
        try:
            return self._not_pinned(self._aio, before) or self._timing(res)
        finally:
            res.release()

    def _not_pinned(self, client, before: int) -> dict | None:
        """A pinned peer counts only replies that came on the lease (the first requests go
        through the broker while it is asked for: in the warm-up)."""
        if self.pin and client.pinned_replies == before:
            return {"error": "answered through the broker: no lease held (not a pinned request)"}
        return None

    def request_sync(self, payload: Any) -> dict | None:
        """One blocking `Client.infer` (its own timeout, 60 s, applies).  The reply is a
        zero-copy view, valid until the next call: the Result is released then (inside that
        call's time, as the asyncio `request` releases its own), so no size pays a copy of
        the reply that the asyncio path does not."""
        if self._sync is None:
            self._sync = self._Client(self._endpoint, transport=self.transport, timeout=60, pin=self.pin)
        self._release_last()
        x = self._stage(self._sync, payload)
        before = self._sync.pinned_replies if self.pin else 0
        res = self._sync.infer("echo", {"x": x}, reply=self.reply)
        self._last = res
        miss = self._not_pinned(self._sync, before)
        if miss is not None:
            return miss
        out = self._timing(res)
        out["reply"] = memoryview(np.ascontiguousarray(res["x"]).reshape(-1).view(np.uint8))
        return out

    def _release_last(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            last.release()

    async def aclose(self) -> None:
        self._staged.clear()
        await self._aio.close()
        self.close()

    def close(self) -> None:
        self._release_last()
        self._staged.clear()
        if self._sync is not None:
            self._sync.close()
            self._sync = None
        if not self._aio.closed:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop here: close the async client on a fresh one
                asyncio.run(self._aio.close())


class _BrokerPeer(Peer):
    transport = "shm"
    broker_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    pin = False

    def available(self) -> tuple[bool, str]:
        return True, ""

    def start(self) -> None:
        self.frontend = self.ipc("frontend.ipc")
        backend = self.ipc("backend.ipc")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.spawn(self.python_module("broker", "--frontend", self.frontend, "--backend", backend,
                                      *self.broker_args), env=env)
        self.spawn(self.python_module("gpu_worker", "--broker", backend, "--model", "echo",
                                      "--max-batch", "1", "--credit", "64", *self.worker_args), env=env)
        # The worker's READY means it sent READY; one round trip proves the broker has it.
        from client_sdk import Client

        with Client(self.frontend, timeout=30) as c:
            import time

            deadline = time.monotonic() + 30
            while not c.mmi_service("echo"):
                if time.monotonic() > deadline:
                    raise RuntimeError("echo worker never registered with the broker")
                time.sleep(0.01)

    def client(self) -> PeerClient:
        return _BrokerClient(self.frontend, self.transport, pin=self.pin)


@register
class BrokerShmPeer(_BrokerPeer):
    name = "broker-shm"
    description = "our broker + echo worker; tensors in shared memory, only the header crosses ZeroMQ"
    transport = "shm"


@register
class PinnedPeer(_BrokerPeer):
    name = "pinned"
    description = ("broker-shm's client with pin=True and a gpu_worker --direct echo: after its lease, "
                   "requests go straight to the worker and back (two hops; docs/protocol.md section 10)")
    transport = "shm"
    worker_args = ("--direct",)
    pin = True

    def start(self) -> None:
        # A leaseholder that says nothing for the broker's client liveness window loses its
        # lease, and a blocking client says nothing between its windows (it has no thread):
        # while the other peers' windows run, seconds pass.  A long window keeps the lease, so
        # every measured request is a pinned one (`request_sync` checks it).
        cfg = os.path.join(self.tmpdir, "pinned-broker.toml")
        with open(cfg, "w") as f:
            f.write("[scheduler]\nclient_liveness = 3600.0\n")
        self.broker_args = ("--config", cfg)
        super().start()


@register
class PinnedIpcPeer(PinnedPeer):
    name = "pinned-ipc"
    description = ("pinned with the worker's local link off (--no-link): the lease's requests cross the ipc "
                   "direct socket, through libzmq's I/O threads (docs/protocol.md section 10.6)")
    worker_args = ("--direct", "--no-link")


@register
class BrokerShmMetricsPeer(_BrokerPeer):
    name = "broker-shm-metrics"
    description = "broker-shm with the broker's metrics on (--http: counted, served on /metrics)"
    transport = "shm"
    broker_args = ("--http", "127.0.0.1:0")


@register
class BrokerInlinePeer(_BrokerPeer):
    name = "broker-inline"
    description = "our broker + echo worker; tensor bytes inline in the ZeroMQ message (the remote path)"
    transport = "inline"


@register
class ProxySdkPeer(_BrokerPeer):
    name = "proxy-sdk"
    description = ("broker-shm's client and gpu_worker echo with zmq.proxy in place of the broker "
                   "(the brokered floor)")
    transport = "shm"
    #: the worker's batch size: 1 as the issue's floor has it (`bench.lean_floor --max-batch`)
    max_batch = 1

    def start(self) -> None:
        self.frontend = self.ipc("front.ipc")
        backend = self.ipc("back.ipc")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.spawn(self.python_module("bench.echo_servers", "proxy", "--front", self.frontend,
                                      "--back", backend), env=env)
        self.spawn(self.python_module("bench.proxied_worker", "--connect", backend, "--model", "echo",
                                      "--max-batch", str(self.max_batch)), env=env)
        # READY means connect() was called; one round trip through the relay proves the path.
        from client_sdk import Client

        with Client(self.frontend, timeout=30) as c:
            if not c.mmi_service("echo"):
                raise PeerStartError(f"{self.name}: the proxied worker does not serve 'echo'")
