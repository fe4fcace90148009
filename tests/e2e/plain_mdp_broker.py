"""A broker that speaks MDP/0.2 as ZeroMQ RFC 18 writes it and nothing more (and RFC 8's
`mmi.service`): no WELCOME, no DONE, no client heartbeats, no extension headers read.  For
tests of our worker and client behind someone else's MDP broker.  No project imports.

    python -m plain_mdp_broker FRONTEND BACKEND

prints `READY frontend=... backend=...` once bound; unknown worker commands are counted on
stderr (`unknown worker command`).  Ends on SIGTERM or after 300 s.
"""
import collections
import signal
import sys
import time

import zmq

MDPC, MDPW = b"MDPC02", b"MDPW02"
READY, REQUEST, PARTIAL, FINAL, HEARTBEAT, DISCONNECT = b"\x01", b"\x02", b"\x03", b"\x04", b"\x05", b"\x06"
C_REQUEST, C_PARTIAL, C_FINAL = b"\x01", b"\x02", b"\x03"
INTERVAL, LIVENESS = 0.2, 3


def main() -> None:
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    front.linger = back.linger = 0
    front.bind(sys.argv[1])
    back.bind(sys.argv[2])
    print(f"READY frontend={sys.argv[1]} backend={sys.argv[2]}", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    workers: dict[bytes, dict] = {}                       # identity -> service, expiry
    idle: dict[bytes, collections.deque] = collections.defaultdict(collections.deque)
    queued: dict[bytes, collections.deque] = collections.defaultdict(collections.deque)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    beat, ends = time.monotonic(), time.monotonic() + 300

    def dispatch(service: bytes) -> None:
        while queued[service] and idle[service]:
            w = idle[service].popleft()
            if w in workers:
                client, body = queued[service].popleft()
                back.send_multipart([w, MDPW, REQUEST, client, b"", *body])

    while not stop and time.monotonic() < ends:
        events = dict(poller.poll(int(INTERVAL * 1000)))
        if front in events:
            client, *f = front.recv_multipart()
            if len(f) >= 3 and f[0] == MDPC and f[1] == C_REQUEST:
                service, body = f[2], f[3:]
                if service == b"mmi.service":
                    known = any(w["service"] == (body[0] if body else b"") for w in workers.values())
                    front.send_multipart([client, MDPC, C_FINAL, service, b"200" if known else b"404"])
                elif service.startswith(b"mmi."):
                    front.send_multipart([client, MDPC, C_FINAL, service, b"501"])
                else:
                    queued[service].append((client, body))
                    dispatch(service)
        if back in events:
            w, *f = back.recv_multipart()
            if len(f) < 2 or f[0] != MDPW:
                continue
            command = f[1]
            if command == READY and len(f) >= 3:
                workers[w] = {"service": f[2], "expiry": time.monotonic() + INTERVAL * LIVENESS}
                idle[f[2]].append(w)
                dispatch(f[2])
                continue
            if w not in workers:
                back.send_multipart([w, MDPW, DISCONNECT])
                continue
            rec = workers[w]
            rec["expiry"] = time.monotonic() + INTERVAL * LIVENESS
            if command in (PARTIAL, FINAL):
                client, body = f[2], f[4:]
                front.send_multipart([client, MDPC, C_PARTIAL if command == PARTIAL else C_FINAL, rec["service"], *body])
                if command == FINAL:
                    idle[rec["service"]].append(w)
                    dispatch(rec["service"])
            elif command == DISCONNECT:
                workers.pop(w, None)
            elif command != HEARTBEAT:
                print(f"unknown worker command {command!r}", file=sys.stderr, flush=True)
        now = time.monotonic()
        if now - beat >= INTERVAL:
            beat = now
            for w, rec in list(workers.items()):
                if rec["expiry"] < now:
                    workers.pop(w)
                else:
                    back.send_multipart([w, MDPW, HEARTBEAT])
    front.close()
    back.close()
    ctx.term()


if __name__ == "__main__":
    main()
