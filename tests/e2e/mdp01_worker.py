"""A worker written to the zguide's Majordomo worker API (MDP/0.1, ZeroMQ RFC 7: the guide's
mdwrkapi.c and its ports, examples/Python/mdwrkapi.py among them), for tests of our broker
with MDP/0.1 workers.  It does what that API does, its asserts included: a DEALER socket,
``"", MDPW01, 0x01, service`` at every (re)connection, a HEARTBEAT only while it waits for
work (checked after each poll), a new socket and a new READY on DISCONNECT or after
`liveness` polls that heard nothing, and an AssertionError (exit 1) on any message that is not
``"", MDPW01, command...`` of at least 3 frames.  No project imports.

    python -m mdp01_worker BACKEND SERVICE [--heartbeat-ms 2500] [--liveness 3] [--hang]

Echoes each request's body.  ``--hang``: takes a request and never answers it (silent, as the
guide's worker is while it works).  Prints ``READY`` on stdout once its first READY went; on
stderr one line per event, numbered per kind: ``REQUEST n <body>``, ``HEARTBEAT n`` (one
from the broker), ``DISCONNECT n`` (the broker told it), ``RECONNECT n`` (its own timer).
Ends after 120 s.
"""
import sys
import time

import zmq

MDPW01 = b"MDPW01"
READY, REQUEST, REPLY, HEARTBEAT, DISCONNECT = b"\x01", b"\x02", b"\x03", b"\x04", b"\x05"


def _opt(args: list, name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def main() -> None:
    args = sys.argv[1:]
    backend, service = args[0], args[1].encode()
    interval = float(_opt(args, "--heartbeat-ms", "2500")) / 1000.0
    liveness_max = int(_opt(args, "--liveness", "3"))
    hang = "--hang" in args
    ctx = zmq.Context()
    counts: dict[str, int] = {}

    def event(kind: str, more: str = "") -> None:
        counts[kind] = counts.get(kind, 0) + 1
        print(f"{kind} {counts[kind]} {more}".rstrip(), file=sys.stderr, flush=True)

    sock = None

    def connect() -> zmq.Socket:
        nonlocal sock
        if sock is not None:
            sock.close(0)
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(backend)
        sock.send_multipart([b"", MDPW01, READY, service])
        return sock

    connect()
    print("READY", flush=True)
    liveness = liveness_max
    heartbeat_at = time.monotonic() + interval
    ends = time.monotonic() + 120
    while time.monotonic() < ends:
        if sock.poll(int(interval * 1000)):
            msg = sock.recv_multipart()
            liveness = liveness_max
            assert len(msg) >= 3, msg  # the guide's: "Don't try to handle errors, just assert noisily"
            assert msg[0] == b"", msg
            assert msg[1] == MDPW01, msg
            command = msg[2]
            if command == REQUEST:
                assert len(msg) >= 5 and msg[4] == b"", msg
                reply_to, body = msg[3], msg[5:]
                event("REQUEST", repr(body))
                if hang:
                    time.sleep(3600)
                sock.send_multipart([b"", MDPW01, REPLY, reply_to, b"", *body])
            elif command == HEARTBEAT:
                event("HEARTBEAT")
            elif command == DISCONNECT:
                event("DISCONNECT", repr(msg))
                connect()
            else:
                event("INVALID", repr(msg))
        else:
            liveness -= 1
            if liveness == 0:
                event("RECONNECT")
                connect()
                liveness = liveness_max
        if time.monotonic() > heartbeat_at:
            sock.send_multipart([b"", MDPW01, HEARTBEAT])
            heartbeat_at = time.monotonic() + interval
    sock.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
