"""The `pytriton` peer's server: NVIDIA PyTriton serving an echo model on Triton's gRPC endpoint.

    python -m bench.triton_echo [--host 127.0.0.1] [--grpc-port 0] [--http]

Starts the `tritonserver` binary bundled in the nvidia-pytriton wheel (it runs on the CPU; no
GPU, CUDA driver or container is needed) with one model, `echo`: input `data` (UINT8, shape
[-1]) returned as output `out`, one model instance, no batching. The Python backend's stub
process hands each request to `infer()` below over PyTriton's ZeroMQ proxy, as in any PyTriton
deployment.

Once the model is loaded and ready it writes one line `READY HOST:GRPC_PORT` to stdout, then
serves until SIGTERM (it then stops Triton, which removes its workspace and shared memory).
Everything else (PyTriton's logs, tritonserver's output) goes to stderr, so the READY line is
the only thing ever written to stdout.

The backend stub links libpython3.X dynamically. The first libpython3.X.so.1.0 the loader finds
must be the running interpreter's own: a system libpython of another patch release (Debian's
3.11.2 under a pyenv 3.11.7, say) loads the interpreter's standard library into a different
runtime and the stub dies with "'_thread.RLock' object has no attribute '_recursion_count'".
`stub_env()` puts the interpreter's LIBDIR first on LD_LIBRARY_PATH; tritonserver and the stub
inherit it.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import sysconfig

MODEL = "echo"
INPUT = "data"
OUTPUT = "out"


def interpreter_libdir() -> str | None:
    """The directory holding this interpreter's shared libpython, or None (a static build)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    ldlib = sysconfig.get_config_var("LDLIBRARY")  # e.g. libpython3.11.so
    if not libdir or not os.path.isdir(libdir):
        return None
    if ldlib and ldlib.endswith(".a"):  # static interpreter: nothing of ours to put first
        return None
    return libdir


def stub_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default os.environ) with the interpreter's LIBDIR first on LD_LIBRARY_PATH."""
    out = dict(os.environ if env is None else env)
    libdir = interpreter_libdir()
    if libdir is None:
        return out
    parts = [p for p in out.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != libdir]
    out["LD_LIBRARY_PATH"] = os.pathsep.join([libdir, *parts])
    return out


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def infer(requests):
    """One reply per request, the input array itself (PyTriton copies it into the response)."""
    return [{OUTPUT: r[INPUT]} for r in requests]


def _print_log_tail(log_file: str | None, lines: int = 40) -> None:
    if not log_file:
        return
    try:
        with open(log_file, errors="replace") as f:
            tail = f.readlines()[-lines:]
    except OSError:
        return
    sys.stderr.write(f"--- last lines of {log_file} ---\n" + "".join(tail))
    sys.stderr.flush()


def serve(host: str, grpc_port: int, http: bool, ready_fd: int, log_file: str | None = None) -> None:
    import numpy as np
    from pytriton.model_config import ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    from bench.echo_servers import serve_until_terminated

    import warnings

    # PyTriton's own gRPC health checks warn that tritonclient ignores their timeouts: noise.
    warnings.filterwarnings("ignore", message="tritonclient.grpc doesn't support timeout")
    os.environ.update(stub_env())
    grpc_port = grpc_port or free_port(host)
    cfg = TritonConfig(
        grpc_address=host,
        grpc_port=grpc_port,
        # PyTriton manages its models over HTTP when HTTP is on, else over gRPC: gRPC alone
        # is one listener (and its threads) less on a small machine.
        allow_http=http,
        http_address=host if http else None,
        http_port=free_port(host) if http else None,
        allow_metrics=False,
        allow_gpu_metrics=False,
        allow_cpu_metrics=False,
        exit_timeout_secs=5,
        log_verbose=0,
        # tritonserver's own log (a 60-line banner at start-up, more at exit): to a file when
        # one is given, its tail printed if start-up fails; else to stderr.
        log_file=log_file,
    )
    # A SIGTERM while Triton starts (the harness gave up waiting) must still stop tritonserver
    # and the backend stub, which the default action would orphan.
    def _abort(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _abort)
    triton = Triton(config=cfg)
    try:
        triton.bind(
            model_name=MODEL,
            infer_func=infer,  # one callable: one model instance
            inputs=[Tensor(name=INPUT, dtype=np.uint8, shape=(-1,))],
            outputs=[Tensor(name=OUTPUT, dtype=np.uint8, shape=(-1,))],
            config=ModelConfig(batching=False),
            strict=False,
        )
        triton.run()  # returns once the server is live and the model is loaded and ready
    except BaseException:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            triton.stop()
        finally:
            _print_log_tail(log_file)
        raise
    os.write(ready_fd, f"READY {host}:{grpc_port}\n".encode())
    os.close(ready_fd)
    serve_until_terminated(triton.stop)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.triton_echo", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=0, help="0: a free port (default)")
    p.add_argument("--http", action="store_true", help="also open Triton's HTTP endpoint")
    p.add_argument("--log-file", help="tritonserver's log goes there instead of stderr")
    a = p.parse_args(argv)

    from bench.echo_servers import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the harness: the harness reaps us
    # Keep stdout for the READY line only: whatever PyTriton or tritonserver (which inherits
    # fd 1) print goes to stderr.
    ready_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(a.host, a.grpc_port, a.http, ready_fd, a.log_file)


if __name__ == "__main__":
    main()
