"""Micro-benchmark of the header codec: encode + decode (with full validation) of a request
header that references tensors in shared memory.  The header's cost must not depend on the
size of the tensors it describes (64 B vs 64 MB).

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
            loc=P.ShmLoc(segment="zinf-1234-5678-0123456789abcdef", offset=4096 + i * nbytes,
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
    return out


if __name__ == "__main__":
    res = run()
    for k, v in res.items():
        print(f"{k:32s} {v:10.3f}")
    print(json.dumps(res))
