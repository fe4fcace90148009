"""A hostile peer, for `python -m bench.chaos --hostile`: `python -m bench.hostile --frontend EP`.

The project's rule for bad input is that it gets a clear, typed error and loses nothing
else: one hostile peer must not harm another's request, crash a process, or read memory it
does not own.  tests/e2e/test_hostile_input.py and test_descriptor_security.py check that one
message at a time against a quiet cluster; this process does it without pause, beside the
chaos run's clients and faults, from a process of its own (so it is its own principal and
its own attested pid).  Each step, paced at `--rate` steps a second, is one of:

  mutate    a valid client message of some kind (REQUEST inline and shm, opaque, MMI,
            CANCEL, HEARTBEAT, DISCONNECT, LEASE), mutated (`mutate_frames`: bit flips,
            truncation, inserted bytes and msgpack's dangerous ones, frames dropped,
            duplicated or spliced), on its frontend connection
  forge     a REQUEST whose shared-memory descriptor names a real segment of another
            process (our parent's and siblings': the chaos clients' inputs, the workers'
            output rings; found in their descriptor tables), mostly an exact copy of one of
            its slots in flight read from its slot table (so that only the ownership check
            stands between it and the victim's bytes), else random fields, or the segment
            named under our own pid: it must be refused
  flood     a burst of valid 16 B requests
  mute      its replies left unread for 0.5-3 s (a peer that stops reading), at most once
            every 5 s
  big       one valid request with a 1-4 MiB inline tensor
  direct    mutated messages on a worker's direct socket (`w-<pid>-*.ipc` in the runtime
            directory, for a sibling process's pid), on a connection kept to it
  link      junk on a worker's local link (`w-<pid>-*.link`, a unix SOCK_SEQPACKET socket):
            mutated messages in its framing, mutated framing, or random bytes
  reconnect the frontend connection closed and opened again (its requests abandoned)

Replies are read as they come (but while muted).  `--only forge,mutate` limits the steps
to those kinds.  A successful reply to a forged request would mean the
worker read memory the sender does not own: the process prints it and exits with status 4
(the chaos run counts it as a failure, as it does a crashed broker or worker).  SIGTERM ends
it with status 0.  Prints `READY hostile` once connected and, as it ends, one JSON line: the
steps it took by kind, the replies it read, and the breaches (if any).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import signal
import socket
import sys
import threading
import time

import numpy as np
import zmq

from broker import protocol as P
from broker.protocol import link
from shm.segment import (HEADER_SIZE, IN_FLIGHT, Q_NBYTES, Q_OFFSET, Q_WORD, QS, SLOT_SIZE, U32, BadDescriptor,
                         SegmentGone, open_checked, self_identity)

FORGED_BASE = 1 << 48  # forged requests' ids count up from here: their replies must be errors
_MEMFD_RE = re.compile(r"/memfd:(zinf-(\d+)-\d+-[0-9a-f]{16})(?: \(deleted\))?")

# msgpack and MDP tokens that break naive parsers: the wrong-type marker, container and
# string lengths of 4 GiB, uint64 max, deep runs of nested containers, zero-size dtypes.
INTERESTING = [b"\xc1", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
               b"\xc6\xff\xff\xff\xff", b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80" + b"\x00" * 7,
               b"\x91" * 2000, b"\x81\xa1k" * 600, b"\xa3|V0", b"\xa3|S0", b"\xa3<U0", b"\xcb\x7f\xf8" + b"\x00" * 6,
               b"\xc7\x01\xff\x00", b"\xd6\xff\xff\xff\xff\xff", P.MAGIC, b"\x00", b"\xff"]


def mutate_bytes(rng: random.Random, b: bytes) -> bytes:
    """1-4 byte-level mutations of `b`."""
    b = bytearray(b)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        if op == 0 and b:  # bit flip
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # truncate
            del b[rng.randrange(len(b)):]
        elif op == 2:  # insert random bytes
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3:  # insert or overwrite with an interesting token
            i = rng.randrange(len(b) + 1)
            tok = rng.choice(INTERESTING)
            b[i:i + (len(tok) if rng.random() < 0.5 else 0)] = tok
        elif op == 4 and b:  # random byte
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif b:  # duplicate a slice
            i = rng.randrange(len(b))
            j = min(len(b), i + rng.randint(1, 32))
            b[j:j] = b[i:j]
    return bytes(b)


def mutate_frames(rng: random.Random, corpus: list[list[bytes]]) -> list[bytes]:
    """One message of `corpus`, with 1-3 mutations: of a frame's bytes, a frame dropped, one
    inserted from another message, or the tail spliced from another message."""
    frames = list(rng.choice(corpus))
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(5)
        if op <= 1 and frames:
            i = rng.randrange(len(frames))
            frames[i] = mutate_bytes(rng, frames[i])
        elif op == 2 and frames:
            del frames[rng.randrange(len(frames))]
        elif op == 3:
            frames.insert(rng.randrange(len(frames) + 1), rng.choice(rng.choice(corpus)))
        else:
            other = rng.choice(corpus)
            frames = frames[:rng.randrange(len(frames) + 1)] + other[rng.randrange(len(other) + 1):]
    return frames


def client_corpus(service: str = "echo") -> list[list[bytes]]:
    """Valid client messages of every kind, the seeds `mutate` starts from (ids below
    FORGED_BASE; the shm one names a segment nobody has)."""
    host = P.local_host_id()
    inline = P.TensorRef(name="x", dtype="<i4", shape=[2, 2], loc=P.InlineLoc(frame=0))
    head = P.encode_header(P.Request(id=11, priority=2, timeout_ms=2000.0, tensors=[inline], meta={"a": [1, {"b": 2}]}))
    shm = P.encode_header(P.Request(id=12, host=host, tensors=[P.TensorRef(
        name="y", dtype="<f4", shape=[4], loc=P.ShmLoc(segment="zinf-1-2-0123456789abcdef-3", offset=0, nbytes=16,
                                                        slot=0, generation=1))]))
    ask = P.encode_header(P.LeaseAsk(id=13, slots=2, host=host, transports=["inline", "shm"]))
    return [
        P.client_request(service, [head, b"\x01" * 16]),
        P.client_request(service, [shm]),
        P.client_request(service, [b"opaque"]),
        P.client_request("mmi.service", [service.encode(), b"token"]),
        P.client_cancel(service, 11),
        P.client_heartbeat(),
        P.client_disconnect(),
        P.client_lease(service, ask),
    ]


def victim_segments(pids: list[int] | None = None) -> list[tuple[str, int]]:
    """(segment name, owner pid) of the shared-memory segments that processes `pids` (our
    parent and its other children, by default) own: memfds, found in their descriptor
    tables (`/proc/<pid>/fd`, readable by the same user), named as a descriptor names them
    (`shm.segment`: the memfd's label, then the owner's descriptor number)."""
    if pids is None:
        pids = [os.getppid(), *siblings()]
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            m = _MEMFD_RE.fullmatch(target)
            if m is not None and int(m.group(2)) == pid:  # its own, not one it mapped from another
                out.append((f"{m.group(1)}-{fd}", pid))
    return out


def live_slots(segment: str, most: int = 64) -> list[tuple[int, int, int, int]]:
    """(offset, nbytes, slot, generation) of the slots of `segment` that are in flight now,
    read from its slot table (the same user may open another process's segment; a reader
    of another uid could not), at most `most`; [] if it cannot be read."""
    try:
        fd, h = open_checked(segment, os.O_RDONLY)
    except (SegmentGone, BadDescriptor, ValueError):
        return []
    try:
        table = os.pread(fd, SLOT_SIZE * int(h["slot_count"]), HEADER_SIZE)
    except OSError:
        return []
    finally:
        os.close(fd)
    q = np.frombuffer(table, "<u8")
    q = q[: len(q) // QS * QS].reshape(-1, QS)
    words = q[:, Q_WORD]
    found = np.nonzero((words & U32) == IN_FLIGHT)[0][:most]
    return [(int(q[i, Q_OFFSET]), int(q[i, Q_NBYTES]), int(i), int(words[i] >> 32)) for i in found]


def forged_request(rng: random.Random, rid: int, service: str = "echo") -> list[bytes] | None:
    """A REQUEST whose descriptor names another process's segment; None when no other
    process has one now.  Mostly an exact copy of one of its slots in flight (offset,
    length, slot, generation: a descriptor that only the ownership check refuses); else
    random fields; and half of those that are not exact name the segment under our own
    pid and start time, with the owner's label and descriptor number (the worker would
    fetch our descriptor of that number, whatever it is).  The header's pid claims the
    owner's (the broker overwrites it with the one it attested)."""
    victims = victim_segments()
    if not victims:
        return None
    seg, pid = rng.choice(victims)
    exact = live_slots(seg) if rng.random() < 0.75 else []
    if exact:
        off, nbytes, slot, gen = rng.choice(exact)
    else:
        nbytes = rng.choice([16, 4096, 65536, 1 << 20])
        off, slot, gen = rng.choice([0, 4096, 65536, rng.randrange(1 << 20)]), rng.randrange(64), rng.randrange(1 << 16)
        if rng.random() < 0.5:
            _, _, _, label, fd = seg.split("-")
            me, start = self_identity()
            seg = f"zinf-{me}-{start}-{label}-{fd}"
    loc = P.ShmLoc(segment=seg, offset=off, nbytes=nbytes, slot=slot, generation=gen)
    req = P.Request(id=rid, host=P.local_host_id(), pid=pid,
                    tensors=[P.TensorRef(name="x", dtype="|u1", shape=[nbytes], loc=loc)])
    return P.client_request(service, [P.encode_header(req)])


def direct_sockets(pids: list[int], suffix: str = ".ipc") -> list[str]:
    """The direct sockets (workers taking leases) of processes `pids`: ipc endpoints, or
    with ``suffix=".link"`` the paths of their local links."""
    d = P.default_runtime_dir()
    paths = [p for pid in pids for p in glob.glob(os.path.join(d, f"w-{pid}-*{suffix}"))]
    return [f"ipc://{p}" for p in paths] if suffix == ".ipc" else paths


def link_junk(rng: random.Random, corpus: list[list[bytes]]) -> list[bytes]:
    """Datagrams for a worker's local link: a mutated message framed as the link frames
    it (`broker.protocol.link`), the framing itself mutated, or bytes at random."""
    op = rng.randrange(3)
    if op == 2:
        return [bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))]
    frames = [bytes(f) for f in mutate_frames(rng, corpus)] or [b""]
    dgrams = [b"".join(bytes(x) for x in d) for d in link.encode(frames)]
    return dgrams if op == 0 else [mutate_bytes(rng, d) for d in dgrams]


def siblings() -> list[int]:
    """The other children of our parent (the chaos run's broker, workers and clients)."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/task/{ppid}/children") as f:
            return [int(x) for x in f.read().split() if int(x) != os.getpid()]
    except OSError:
        return []


class Hostile:
    """The steps above, on one frontend connection at a time."""

    STEPS = ("mutate",) * 24 + ("forge",) * 6 + ("flood",) * 2 + ("direct",) * 2 + ("link",) * 2 + ("reconnect",) * 2 + (
        "mute", "big")
    MUTE_EVERY = 5.0  # seconds at least from the end of one mute to the next
    BIG = (1 << 20, 4 << 20)  # a big step's inline tensor, bytes (least, most)

    def __init__(self, frontend: str, seed: int, *, service: str = "echo", only: tuple[str, ...] = (),
                 ctx: zmq.Context | None = None):
        unknown = set(only) - set(self.STEPS)
        if unknown:
            raise ValueError(f"no such step: {', '.join(sorted(unknown))} (steps: {', '.join(sorted(set(self.STEPS)))})")
        self.steps = tuple(k for k in self.STEPS if k in only) if only else self.STEPS
        self.ctx = ctx or zmq.Context.instance()
        self.frontend = frontend
        self.rng = random.Random(seed)
        self.service = service
        self.corpus = client_corpus(service)
        self.next_forged = FORGED_BASE
        self.forged: set[int] = set()  # ids of the forged requests sent (a mutation may make any id)
        self.next_id = 1 << 32
        self.muted_until = -self.MUTE_EVERY  # replies are left unread until then (a mute step)
        self.counts: dict[str, int] = {}
        self.replies = 0
        self.breaches: list[str] = []
        self.sock = self._open(frontend)
        self.direct: dict[str, zmq.Socket] = {}  # worker direct socket -> our connection to it

    def _open(self, endpoint: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 0
        s.sndhwm = s.rcvhwm = 10_000
        s.connect(endpoint)
        return s

    def _send(self, sock: zmq.Socket, frames) -> None:
        if not frames:
            frames = [b""]  # a message has at least one frame
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass  # the peer is gone or slow: a hostile peer does not wait

    def _direct_to(self, endpoint: str) -> zmq.Socket:
        """A connection to a worker's direct socket, kept while its file is there (one closed
        at once, linger 0, would drop what it queued before connecting)."""
        for ep in [ep for ep in self.direct if not os.path.exists(ep[len("ipc://"):])]:
            self.direct.pop(ep).close(0)  # that worker is gone
        s = self.direct.get(endpoint)
        if s is None:
            s = self.direct[endpoint] = self._open(endpoint)
        return s

    def step(self) -> str:
        """One step; its kind, or "idle" when it found nothing to aim at (no other
        process's segment, no worker's direct socket) or a mute came too soon."""
        kind = self._step(self.rng.choice(self.steps))
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return kind

    def _step(self, kind: str) -> str:
        if kind == "mutate":
            self._send(self.sock, mutate_frames(self.rng, self.corpus))
        elif kind == "forge":
            frames = forged_request(self.rng, self.next_forged, self.service)
            if frames is None:
                return "idle"
            self.forged.add(self.next_forged)
            self.next_forged += 1
            self._send(self.sock, frames)
        elif kind == "flood":
            x = np.zeros(16, np.uint8)
            for _ in range(self.rng.randint(20, 200)):
                self.next_id += 1
                head = P.encode_header(P.Request(id=self.next_id, tensors=[
                    P.TensorRef(name="x", dtype="|u1", shape=[16], loc=P.InlineLoc(frame=0))]))
                self._send(self.sock, P.client_request(self.service, [head, x]))
        elif kind == "direct":
            eps = direct_sockets(siblings())
            if not eps:
                return "idle"
            s = self._direct_to(self.rng.choice(eps))
            for _ in range(self.rng.randint(1, 5)):
                self._send(s, mutate_frames(self.rng, self.corpus))
        elif kind == "link":
            paths = direct_sockets(siblings(), ".link")
            if not paths:
                return "idle"
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.settimeout(1.0)  # a connect or send that would block is given up
                s.connect(self.rng.choice(paths))
                for _ in range(self.rng.randint(1, 5)):
                    for d in link_junk(self.rng, self.corpus):
                        s.send(d)
            except OSError:
                pass  # the worker ended it (it may, for junk), or is gone
            finally:
                s.close()
        elif kind == "mute":
            now = time.monotonic()
            if now < self.muted_until + self.MUTE_EVERY:
                return "idle"
            self.muted_until = now + self.rng.uniform(0.5, 3.0)
        elif kind == "big":
            n = self.rng.randint(*self.BIG)
            self.next_id += 1
            head = P.encode_header(P.Request(id=self.next_id, tensors=[
                P.TensorRef(name="x", dtype="|u1", shape=[n], loc=P.InlineLoc(frame=0))]))
            self._send(self.sock, P.client_request(self.service, [head, bytes(n)]))
        else:
            self.sock.close(0)
            self.sock = self._open(self.frontend)
        return kind

    def read(self, most: int = 1000) -> None:
        """Take what has come back (unless muted); note a forged request's success."""
        if time.monotonic() < self.muted_until:
            return
        for _ in range(most):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.replies += 1
            try:
                m = P.parse_broker_to_client(frames)
                if m.command != P.C_FINAL or not m.body or not P.is_header(m.body[0]):
                    continue
                rep = P.decode_reply(m.body[0], len(m.body) - 1)
            except P.ProtocolError:
                continue
            if rep.error is None and rep.id in self.forged:
                self.breaches.append(f"a forged descriptor was served: reply {rep.id} with {rep.tensors!r}")

    def close(self) -> None:
        self.sock.close(0)
        for s in self.direct.values():
            s.close(0)
        self.direct.clear()


def main(argv: list[str] | None = None) -> int:
    from bench.echo_servers import die_with_parent

    ap = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.splitlines()[0])
    ap.add_argument("--frontend", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", type=float, default=200.0, help="steps a second (default 200)")
    ap.add_argument("--service", default="echo")
    ap.add_argument("--only", default="", help="these steps only, comma-separated (default: every kind)")
    a = ap.parse_args(argv)
    die_with_parent()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    h = Hostile(a.frontend, a.seed, service=a.service, only=tuple(k for k in a.only.split(",") if k))
    print("READY hostile", flush=True)
    pause = 1.0 / a.rate
    try:
        while not stop.is_set():
            h.step()
            h.read()
            if h.breaches:
                print(json.dumps({"breaches": h.breaches, "steps": h.counts, "replies": h.replies}), flush=True)
                return 4
            stop.wait(pause)  # the pace of the steps, not a synchronisation
    finally:
        h.close()
    print(json.dumps({"breaches": [], "steps": h.counts, "replies": h.replies}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
