"""Micro-benchmark of the header codec: encode + decode (with full validation) of a request
header that references tensors in shared memory.  The header's cost must not depend on the
size of the tensors it describes (64 B vs 64 MB).  Also: sending and receiving one 5-frame
MDP message over inproc with pyzmq's send/recv_multipart vs `broker.protocol.wire`.

    python -m bench.micro_protocol
"""
from __future__ import annotations

import json
import statistics
import time

from broker import protocol as P


def _request(n_tensors: int, nbytes: int) -> P.Request:
    refs = [
        P.TensorRef(
            name=f"t{i}",
            dtype="|u1",
            shape=[nbytes],
            loc=P.ShmLoc(segment="zinf-1234-5678-0123456789abcdef-5", offset=4096 + i * nbytes,
                         nbytes=nbytes, slot=i, generation=1),
        )
        for i in range(n_tensors)
    ]
    return P.Request(id=1, priority=1, timeout_ms=50.0, host=P.local_host_id(), pid=1234, tensors=refs)


def _time_us(fn, iters: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        fn()
    return (time.perf_counter_ns() - t0) / iters / 1e3


def run(repeats: int = 5, iters: int = 20000) -> dict:
    out: dict[str, float] = {}
    for label, n, size in (("4x64B", 4, 64), ("4x64MiB", 4, 64 << 20), ("1x64B", 1, 64)):
        req = _request(n, size)
        enc = lambda: P.encode_header(req)  # noqa: E731
        frame = enc()
        dec = lambda: P.decode_request(frame, 0)  # noqa: E731
        both = lambda: P.decode_request(P.encode_header(req), 0)  # noqa: E731
        out[f"encode_{label}_us"] = statistics.median(_time_us(enc, iters) for _ in range(repeats))
        out[f"decode_{label}_us"] = statistics.median(_time_us(dec, iters) for _ in range(repeats))
        out[f"encode_decode_{label}_us"] = statistics.median(_time_us(both, iters) for _ in range(repeats))
        out[f"header_bytes_{label}"] = len(frame)
    out["size_ratio_64MiB_vs_64B"] = out["encode_decode_4x64MiB_us"] / out["encode_decode_4x64B_us"]
    out.update(_multipart(repeats, iters))
    return out


def _multipart(repeats: int, iters: int) -> dict[str, float]:
    import zmq

    from broker.protocol.wire import recv_frames, send_frames

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.sndhwm = b.rcvhwm = 0
    a.bind("inproc://micro-wire")
    b.connect("inproc://micro-wire")
    frames = [P.MDPC, P.C_REQUEST, b"echo", P.encode_header(_request(1, 64)), b"x" * 16]
    try:
        def timed(send, recv) -> tuple[float, float]:
            t_send = _time_us(send, iters)
            t_recv = _time_us(recv, iters)
            return t_send, t_recv

        rows = {"pyzmq": (lambda: a.send_multipart(frames, copy=False), lambda: b.recv_multipart(copy=False)),
                "wire": (lambda: send_frames(a, frames), lambda: recv_frames(b))}
        out = {}
        for name, (send, recv) in rows.items():
            runs = [timed(send, recv) for _ in range(repeats)]
            out[f"send_5_frames_{name}_us"] = statistics.median(r[0] for r in runs)
            out[f"recv_5_frames_{name}_us"] = statistics.median(r[1] for r in runs)
        return out
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


if __name__ == "__main__":
    res = run()
    for k, v in res.items():
        print(f"{k:32s} {v:10.3f}")
    print(json.dumps(res))
