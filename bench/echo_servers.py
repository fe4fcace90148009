"""Server processes of the floor peers: a ZeroMQ echo worker, a libzmq proxy and a gRPC echo.

Each runs as `python -m bench.echo_servers KIND ...` in its own process and writes one line
`READY [info]` to stdout once it can serve; the parent (bench.peers) blocks on that line
instead of sleeping. Nothing else is ever written to stdout, so the parent may close its end
of the pipe after the handshake.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

# gRPC's default 4 MB cap would refuse the 6.2 MB and 64 MiB payloads the comparison is about.
GRPC_MAX_MESSAGE = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
]
GRPC_METHOD = "/zinfbench.Echo/Stream"


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM us when the harness dies, so a crashed or killed bench run
    never leaves echo servers behind."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass
    # The parent may have died between fork and prctl.
    if os.getppid() == 1:
        sys.exit(0)


def _ready(info: str = "") -> None:
    sys.stdout.write(f"READY {info}".rstrip() + "\n")
    sys.stdout.flush()


def run_zmq_echo(bind: str | None, connect: str | None) -> None:
    """Echo every multipart message back unchanged, zero-copy.

    Bound as a ROUTER (direct peer) the first frame is the client's routing id; connected as a
    DEALER behind the proxy the frames arrive with the proxy's envelope. Either way echoing
    the frames verbatim routes the reply back, so one loop serves both topologies.
    """
    import zmq

    ctx = zmq.Context()
    if bind:
        sock = ctx.socket(zmq.ROUTER)
        # ROUTER silently drops on HWM; an open-loop overload must queue, not lose replies.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(bind)
    else:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(connect)
    sock.setsockopt(zmq.LINGER, 0)
    _ready()
    recv = sock.recv_multipart
    send = sock.send_multipart
    while True:
        send(recv(copy=False), copy=False)


def run_proxy(front: str, back: str) -> None:
    """A pure libzmq relay: after the binds, zmq.proxy never returns to Python."""
    import zmq

    ctx = zmq.Context()
    f = ctx.socket(zmq.ROUTER)
    b = ctx.socket(zmq.DEALER)
    for s in (f, b):
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
    f.bind(front)
    b.bind(back)
    _ready()
    zmq.proxy(f, b)


def run_grpc(host: str, port: int) -> None:
    """Bidirectional stream of raw bytes: generic handler, no serializers, no protoc."""
    import asyncio

    import grpc

    async def stream(request_iterator, context):
        async for msg in request_iterator:
            yield msg

    async def main() -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        service, method = GRPC_METHOD.strip("/").split("/")
        handler = grpc.method_handlers_generic_handler(
            service,
            {method: grpc.stream_stream_rpc_method_handler(stream)},  # None = bytes as-is
        )
        server.add_generic_rpc_handlers((handler,))
        bound = server.add_insecure_port(f"{host}:{port}")
        await server.start()
        _ready(str(bound))
        await server.wait_for_termination()

    asyncio.run(main())


def serve_until_terminated(cleanup) -> None:
    """Block until SIGTERM, then run `cleanup`: these servers start their own helper processes
    (Ray's GCS and raylet, the Triton binary) that the default SIGTERM action would orphan."""
    import threading

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    try:
        cleanup()
    finally:
        os._exit(0)


def run_rayserve(port: int) -> None:
    # Not exercised in CI (ray is not a dependency); kept to the documented public API.
    import ray
    from ray import serve
    from starlette.responses import Response

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    @serve.deployment
    class Echo:
        async def __call__(self, request):
            return Response(await request.body(), media_type="application/octet-stream")

    serve.run(Echo.bind(), route_prefix="/echo")
    _ready(str(port))

    def cleanup() -> None:
        serve.shutdown()
        ray.shutdown()

    serve_until_terminated(cleanup)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.echo_servers")
    sub = p.add_subparsers(dest="kind", required=True)
    z = sub.add_parser("zmq-echo")
    g = z.add_mutually_exclusive_group(required=True)
    g.add_argument("--bind")
    g.add_argument("--connect")
    x = sub.add_parser("proxy")
    x.add_argument("--front", required=True)
    x.add_argument("--back", required=True)
    r = sub.add_parser("grpc")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=0)
    y = sub.add_parser("rayserve")
    y.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)

    die_with_parent()
    # SIGTERM is how peers stop us; the default action (exit without cleanup) is what we want
    # even while blocked inside libzmq, so make sure nothing inherited a different handler.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the harness: the harness reaps us
    if a.kind == "zmq-echo":
        run_zmq_echo(a.bind, a.connect)
    elif a.kind == "proxy":
        run_proxy(a.front, a.back)
    elif a.kind == "grpc":
        run_grpc(a.host, a.port)
    else:
        run_rayserve(a.port)


if __name__ == "__main__":
    main()
