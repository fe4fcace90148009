"""`python -m gpu_worker --broker EP --model NAME [--device cpu|cuda:N] [--max-batch N] [--backend tensorrt]`

A tcp `--broker` needs `--server-key` (the broker's public certificate) and `--worker-key`
(this worker's secret certificate, in the broker's `--worker-keys` allow-list), or `--insecure`;
without them the worker exits 2 at once, saying so (docs/security.md).

Loads and warms the model, registers with the broker (READY with its credit, host and
transports), prints one line `READY service=<name> pid=<pid> device=<dev>` (then
`health=...` and `direct=<endpoint>` and `link=<path>` when asked for) on stdout once
the broker acknowledged the registration (its WELCOME; from a broker that sends none, after
two heartbeat intervals), and serves until SIGTERM, on which it finishes what it holds, sends DISCONNECT and exits 0.
`--direct` makes it take leases (pinned streams: docs/protocol.md section 10) on a direct socket
in the runtime directory.  `--model` takes a shipped name (echo, cartoon, convnet, chunks) or `package.module:factory`
(docs/models.md).  A model that cannot be loaded (bad spec, import error, factory raising, no
such device, a `name` with whitespace or control characters, malformed `inputs`/`outputs`
declarations) or whose warm-up raises, and an option the worker cannot run with
(`--max-batch 0`), or a `--backend` that cannot run the model (the numpy backend for a torch
model; TensorRT for a model without example inputs or that does not export), is one line on
stderr saying what to change, and exit 2.
"""
from __future__ import annotations

import argparse
import errno
import logging
import signal
import sys

# Threads inherit the signal mask of the thread that starts them.  Those the imports below
# start (numpy's BLAS pool) are started with SIGTERM, SIGINT and SIGHUP blocked, so that
# the kernel hands these to the main thread, and its handler runs at once even while that
# thread waits in a model's system call (broker.protocol.logs.block_stop_signals says why);
# the main thread takes them again once the imports are done.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
_MASK = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)

import numpy  # noqa: E402,F401  (here for its BLAS pool's threads: nothing imported below loads it now)

from broker import protocol as P  # noqa: E402
from broker.protocol.heap import freeze_startup_heap  # noqa: E402
from broker.protocol.limits import raise_nofile_limit  # noqa: E402
from broker.protocol.logs import (  # noqa: E402
    add_log_options, announce, enable_crash_dumps, hold_std_descriptors, ignore_stop_signals, setup_logging,
)
from broker.protocol.pid1 import become_init_if_pid1  # noqa: E402

signal.pthread_sigmask(signal.SIG_SETMASK, _MASK)


def add_model_options(ap: argparse.ArgumentParser) -> None:
    """The options of any process that runs our Worker loop (also `bench.proxied_worker`)."""
    ap.add_argument("--model", default="echo", help="shipped model name or package.module:factory (default echo)")
    ap.add_argument("--service", default=None, help="service name to register (default: the model's name)")
    ap.add_argument("--device", default=None,
                    help="auto (default: cuda:0 when there is one, else cpu), cpu, cuda or cuda:N")
    ap.add_argument("--max-batch", type=int, default=8, help="requests per batch at most (default 8)")
    ap.add_argument("--max-delay-ms", type=float, default=2.0, help="longest a batch waits for company (default 2)")
    ap.add_argument("--batching", choices=("latency", "throughput"), default="latency",
                    help="latency (default): a batch waits for company only while the broker has a backlog "
                         "(a lone client never waits); throughput: also on arrival-rate evidence alone "
                         "(docs/models.md, 'Batching policy')")
    ap.add_argument("--lifo-after-ms", type=_number_any, default=100.0, metavar="MS",
                    help="a batch group holding more than a batch that lost a request to its deadline within MS ms is "
                         "congested: each client's "
                         "requests newest first, as at the broker (default 100, as the broker's; negative: "
                         "never, first in first out always; docs/models.md, 'Batching policy')")
    ap.add_argument("--heartbeat-interval", type=float, default=1.0,
                    help="seconds, until the broker's WELCOME gives its own (default 1.0)")
    ap.add_argument("--out-capacity-mb", type=_positive_int, default=256, help="output ring size, MiB (default 256)")
    ap.add_argument("--transports", default="inline,shm",
                    help="comma-separated: inline, shm, cuda (default inline,shm)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--keep-warm-ms", type=_non_negative, default=None, metavar="MS",
                    help="while idle, run a batch of one every MS ms without work, to keep the device's clocks "
                         "up; 0: off (default: 50 on a CUDA device, off on the CPU)")
    ap.add_argument("--keep-warm-util", type=_fraction, default=0.6, metavar="FRACTION",
                    help="keep warm only while the worker was busy at most FRACTION of the recent window "
                         "(ten periods; default 0.6)")
    add_log_options(ap)  # --log-level, --log-format


def model_config(args: argparse.Namespace) -> dict:
    """WorkerConfig keywords for the options of `add_model_options`."""
    return dict(
        model=args.model,
        service=args.service,
        device=args.device,
        max_batch=args.max_batch,
        max_delay=args.max_delay_ms / 1000.0,
        batching=args.batching,
        lifo_after=None if args.lifo_after_ms < 0 else args.lifo_after_ms / 1000.0,
        heartbeat_interval=args.heartbeat_interval,
        out_capacity=args.out_capacity_mb << 20,
        warmup=not args.no_warmup,
        transports=tuple(t for t in args.transports.split(",") if t),
        keep_warm=None if args.keep_warm_ms is None else args.keep_warm_ms / 1000.0,
        keep_warm_util=args.keep_warm_util,
    )


def _number(text: str, want: str) -> float:
    """`text` as a float; what it must be otherwise (argparse named the type function:
    "invalid _non_negative value: 'abc'", the configuration hunt)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, not {text!r}") from None


def _number_any(text: str) -> float:
    v = _number(text, "a number")
    if v != v:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}")
    return v


def _non_negative(text: str) -> float:
    v = _number(text, "a number >= 0")
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, not {text!r}")
    return v


def _positive_int(text: str) -> int:
    """A size in MiB: checked here, where the message can name what was typed (the config
    holds bytes)."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of MiB >= 1, not {text!r}")
    return v


def _fraction(text: str) -> float:
    v = _number(text, "a fraction between 0 and 1")
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1, not {text!r}")
    return v


def _fail(message: str) -> None:
    """A start-up failure as one line on stderr (whitespace, newlines included, collapsed)."""
    text = " ".join(message.split())
    if len(text) > 1000:
        text = text[:997] + "..."
    print(f"python -m gpu_worker: {text}", file=sys.stderr, flush=True)


def _backend_failure(backend: str, model: str, message: str) -> str:
    """What `make_backend` raised while building the backend, as what to change on the command line."""
    message = message.replace(" (use make_backend)", "")  # library advice, meaningless here
    if "example_inputs" in message:
        advice = ("give the model example_inputs() returning one item per input (docs/models.md), "
                  "or use --backend auto")
    elif backend != "auto":
        advice = "use --backend auto (it follows the model's framework)"
    else:
        advice = "fix the model (docs/models.md)"
    return f"backend {backend!r} cannot run model {model!r}: {message}; {advice}"


def direct_tcp_problem(endpoint: str, worker_key: str | None, insecure: bool) -> str | None:
    """Why ``--direct-tcp endpoint`` cannot be used (None: it can): checked before the model
    loads.  The endpoint is what leaseholders are told to connect to, so it names a host they
    can reach, not a wildcard."""
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        return "give a tcp://HOST:PORT endpoint"
    port = P.tcp_port_problem(endpoint)
    if port is not None:
        return port
    host = endpoint[6:].rsplit(":", 1)[0]
    if host in ("*", "0.0.0.0", "::", "[::]", ""):
        return (f"{host or 'an empty host'} is a wildcard, not an address clients can connect to; give this host's "
                "address (it is what leaseholders are told)")
    if worker_key is None and not insecure:
        return ("a tcp direct socket is a CurveZMQ server: give this worker its key pair (--worker-key "
                "NAME.key_secret), or --insecure for plain tcp (docs/security.md)")
    return None


def _endpoint_problem(endpoint: str, curve=None) -> str | None:
    """Why libzmq refuses to connect to ``endpoint`` (an unknown scheme, an ipc path longer
    than a socket address holds, a malformed tcp address), or None.  A connect is checked
    at once and starts nothing that outlives the socket.  ``curve``: the link's CURVE keys
    (`upstream.link_keys`), which the probe speaks with too."""
    import zmq

    from broker.protocol import curve as C

    port = P.tcp_port_problem(endpoint) or P.endpoint_text_problem(endpoint)
    if port is not None:
        return port
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        P.ipv6_for(sock, endpoint)
        # libzmq checks the address at once but connects in its I/O thread, which often
        # dials before the close below reaches it, and now and then gets as far as the
        # greeting: a plain one made a broker with keys log "a worker's handshake failed:
        # it and this endpoint disagree on CurveZMQ" for a worker whose keys were right
        # (and took that line's 10 s throttle from a real mismatch).  With the link's keys
        # the probe, if it gets that far, is the worker's own handshake.
        C.configure_peer(sock, curve)
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        if e.errno == errno.ENAMETOOLONG:
            return (f"the ipc path is {len(endpoint) - len('ipc://')} bytes, and a socket path holds at most "
                    f"107: use a shorter path")
        return f"{e.strerror}; check the endpoint's spelling"
    finally:
        sock.close(linger=0)
    return None


def build_parser() -> argparse.ArgumentParser:
    """`python -m gpu_worker`'s options (the launcher checks a pool's `extra_args` with it)."""
    # No abbreviations: a launcher refuses a pool's extra_args that set its own flags
    # (broker.config.LAUNCHERS_FLAGS), and an abbreviation would slip past it.
    ap = argparse.ArgumentParser(prog="python -m gpu_worker", description=__doc__.splitlines()[0],
                                 allow_abbrev=False)
    ap.add_argument("--broker", default=None, help="broker backend endpoint (default: the broker's ipc default)")
    add_model_options(ap)
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "numpy", "tensorrt"),
                    help="auto follows the model's framework; tensorrt needs tensorrt, onnx and a GPU")
    ap.add_argument("--cuda-pool-mb", type=_positive_int, default=256,
                    help="device pool for outputs kept on the GPU, MiB (CUDA workers only; default 256)")
    ap.add_argument("--max-cost", type=float, default=float("inf"),
                    help="batch cost bound (model's cost units; default: no bound)")
    ap.add_argument("--credit", type=int, default=None, help="requests held at once (default 2*max-batch)")
    ap.add_argument("--heartbeat-liveness", type=int, default=3,
                    help="silent intervals before the broker is presumed lost, until its WELCOME gives its own "
                         "(default 3)")
    ap.add_argument("--no-direct-reply", action="store_true",
                    help="send every reply through the broker, even to clients on this host")
    ap.add_argument("--drain-grace-s", type=float, default=30.0,
                    help="on SIGTERM, seconds results stay readable for clients that have not released them "
                         "(default 30)")
    ap.add_argument("--direct", action="store_true",
                    help="take leases (pinned streams, docs/protocol.md section 10): bind a direct socket in the "
                         "runtime directory, on which leaseholding clients send requests straight to this worker")
    ap.add_argument("--direct-tcp", default=None, metavar="tcp://HOST:PORT",
                    help="with --direct: the direct socket on this tcp address instead of the runtime directory, for "
                         "remote leaseholders (a CurveZMQ server with --worker-key's key pair, admitting only "
                         "clients that hold a lease here; docs/security.md); HOST must be one clients can reach, "
                         "PORT may be 0 (any free port)")
    ap.add_argument("--no-link", action="store_true",
                    help="with --direct: no local link beside the direct socket (docs/protocol.md section 10.6); "
                         "clients on this host then use the ipc direct socket")
    ap.add_argument("--done-delay-ms", type=float, default=5.0,
                    help="longest a DONE for direct replies waits to gather more "
                         "(default 5; docs/protocol.md section 8)")
    ap.add_argument("--server-key", default=None,
                    help="tcp broker: its public certificate (server.key) or z85 key; default $ZMQ_INFER_SERVER_KEY")
    ap.add_argument("--worker-key", default=None,
                    help="tcp broker: this worker's secret certificate (NAME.key_secret); default $ZMQ_INFER_WORKER_KEY")
    ap.add_argument("--insecure", action="store_true", help="tcp broker without CurveZMQ (plain, unauthenticated)")
    ap.add_argument("--health-port", metavar="[HOST:]PORT", default=None,
                    help="serve /v2/health/live and /v2/health/ready for probes of this process "
                         "(PORT alone: 127.0.0.1; a pod: 0.0.0.0:PORT)")
    return ap


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        # pid 1 of a container: SIGTERM at its default action (a worker loading its model)
        # does nothing there, and orphans are ours to reap; an init takes that place and
        # runs us again as pid 2 (broker.protocol.pid1)
        become_init_if_pid1()
    hold_std_descriptors()  # a closed stderr's number must not go to a socket we then write "stderr" into
    from gpu_worker.worker import (
        DIRECT_LINGER_MS, ConfigError, WarmupError, Worker, WorkerConfig, ignore_other_signals, install_sigterm_drain,
    )

    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format, "worker")
    # Until it serves (its model loading and warming up: minutes for a large one), a worker
    # has nothing to drain: SIGTERM and SIGINT end it at once, as their default actions do
    # (Python's own SIGINT handler raised KeyboardInterrupt in the model's code: a traceback
    # on stderr), and SIGHUP, SIGUSR1 and SIGUSR2 are said and ignored, as once it serves
    # (their default action ended it with no line; docs/operations.md).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    ignore_other_signals()
    # A crash in native code (a model's extension on one input, libzmq's assertions): every
    # thread's Python stack on stderr, written at once (log lines still queued for the
    # writer thread may not get out), and never blocked by a stderr nobody reads.
    enable_crash_dumps()

    health_at = None
    if args.health_port is not None:  # checked before the model loads (minutes, for a large one)
        from gpu_worker.health import parse_port

        try:
            health_at = parse_port(args.health_port)
        except ValueError as e:  # the message names the flag and what it takes
            print(f"python -m gpu_worker: {e}", file=sys.stderr, flush=True)
            return 2
    try:
        broker = args.broker or P.default_endpoints()[1]
    except P.RuntimeDirError as e:  # the runtime directory cannot be made or is not ours
        print(f"python -m gpu_worker: {e}", file=sys.stderr, flush=True)
        return 2
    from gpu_worker.upstream import CurveKeyError, link_keys

    try:  # before the model loads: a worker that cannot connect says so at once
        curve = link_keys(broker, args.server_key, args.worker_key, args.insecure)
    except CurveKeyError as e:
        print(f"python -m gpu_worker: {e}", file=sys.stderr, flush=True)
        return 2
    why = _endpoint_problem(broker, curve)
    if why is not None:
        print(f"python -m gpu_worker: cannot connect to --broker {broker}: {why}", file=sys.stderr, flush=True)
        return 2
    if args.insecure and broker.startswith("tcp://"):
        logging.getLogger("gpu_worker").warning("INSECURE: connecting to %s as plain tcp (--insecure)", broker)
    if args.direct_tcp is not None:
        why = direct_tcp_problem(args.direct_tcp, args.worker_key, args.insecure)
        if why is not None:
            print(f"python -m gpu_worker: --direct-tcp {args.direct_tcp}: {why}", file=sys.stderr, flush=True)
            return 2
        if args.insecure:
            logging.getLogger("gpu_worker").warning("INSECURE: the direct socket %s is plain tcp (--insecure)",
                                                    args.direct_tcp)
    cfg = WorkerConfig(
        broker=broker,
        **model_config(args),
        max_cost=args.max_cost,
        credit=args.credit,
        heartbeat_liveness=args.heartbeat_liveness,
        backend=args.backend,
        cuda_pool_capacity=args.cuda_pool_mb << 20,
        direct_reply=not args.no_direct_reply,
        direct=args.direct or args.direct_tcp is not None,
        direct_link=not args.no_link,
        direct_tcp=args.direct_tcp,
        done_delay=args.done_delay_ms / 1000.0,
        drain_grace=args.drain_grace_s,
        server_key=args.server_key,
        worker_key=args.worker_key,
        insecure=args.insecure,
    )
    from gpu_worker.backends import BackendError, BackendUnavailable
    from gpu_worker.devices import DeviceError, DeviceUnavailable
    from gpu_worker.leases import DirectSocketError
    from gpu_worker.models import ModelLoadError
    from shm.errors import ShmError

    raise_nofile_limit()  # a descriptor per client segment, pidfd and reply socket (broker.protocol.limits)
    from broker.protocol.wire import warm_zero_copy

    try:
        # pyzmq's zero-copy sends (an output of 64 KiB or more sent inline) need a thread and
        # descriptors of their own: started now, not at the first such reply, when they may
        # be gone (wire.send_frames then copies the reply: it still goes out whole).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # its thread, as the imports' (above)
        try:
            warm_zero_copy()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    except Exception as e:
        logging.getLogger("gpu_worker").warning("pyzmq's zero-copy sends could not be started (%s: %s); large "
                                                "inline replies are copied", type(e).__name__, e)
    try:
        worker = Worker(cfg)
    except ConfigError as e:  # checked before anything loads: the message names the option
        _fail(str(e))
        return 2
    except BackendUnavailable as e:
        print(f"python -m gpu_worker: backend {args.backend!r} is unavailable: {e}", file=sys.stderr, flush=True)
        return 2
    except BackendError as e:  # the backend cannot run this model (a framework it does not take, no example inputs)
        _fail(_backend_failure(args.backend, args.model, str(e)))
        return 2
    except (DeviceError, DeviceUnavailable) as e:  # (said as the model's load before: the architecture audit)
        _fail(f"--device {args.device or 'auto'}: {e}")
        return 2
    except ModelLoadError as e:  # the message says what was expected
        _fail(f"cannot load model {args.model!r}: {e}")
        return 2
    except DirectSocketError as e:
        _fail(str(e))
        return 2
    except ShmError as e:  # its output ring cannot be made (--out-capacity-mb over what the host has)
        _fail(f"{e}; give a smaller --out-capacity-mb")
        return 2
    except WarmupError as e:
        from gpu_worker.backends import WritesInputs

        if isinstance(e.__cause__, WritesInputs):  # (--no-warmup would only move the crash to serving)
            _fail(f"{e.__cause__} (docs/models.md, \"Never write to an input\")")
            return 2
        _fail(f"model {args.model!r} failed its warm-up on its example_inputs: {e}; "
              "make example_inputs() match the inputs the model takes (and its declared `inputs`), "
              "fix the model, or start with --no-warmup (docs/models.md)")
        return 2
    health = None
    if health_at is not None:
        from broker.protocol.httpserve import host_port
        from gpu_worker.health import HealthServer, loop_alive

        try:
            health = HealthServer(
                health_at,
                live=lambda: loop_alive(lambda: worker.last_loop,
                                        lambda: worker.heartbeat_interval * worker.heartbeat_liveness,
                                        lambda: bool(worker.running)),
                # (`signals`: a SIGTERM counted during a batch, before the loop sets `stop`:
                # draining from that moment, as the broker already sees it)
                ready=lambda: worker.ready and not worker.stop.is_set() and not worker.signals)
        except (ValueError, OSError) as e:  # it cannot listen there (taken, not this host's address)
            worker.close()
            print(f"python -m gpu_worker: --health-port {args.health_port}: {e}", file=sys.stderr, flush=True)
            return 2

    def ready() -> None:
        extra = f" health={host_port(*health.address)}" if health is not None else ""
        if worker.direct_socket is not None:
            extra += f" direct={worker.direct_socket.endpoint}"
            if worker.direct_socket.link is not None:
                extra += f" link={worker.direct_socket.link.path}"
        announce(f"READY service={worker.service} pid={worker.pid} device={worker.device}{extra}")

    # Startup is over (the model loaded and warmed up): what it made lives as long as we do.
    freeze_startup_heap()
    try:
        with worker as w:
            install_sigterm_drain(w)
            w.serve(ready_cb=ready)
    finally:
        if health is not None:
            health.close()
    # Drained: a signal from now on has nothing left to hurry.  Ignored, because the
    # interpreter's exit puts the default actions back, and a SIGTERM during it (tens of ms:
    # a second one sent just after the first) ended the worker with -15 instead of its 0.
    ignore_stop_signals()
    # Closed sockets may still hold replies sent straight to clients (and the DISCONNECT):
    # give them a moment to leave before the process does.
    import zmq

    zmq.Context.instance().destroy(linger=DIRECT_LINGER_MS)
    if worker.refused is not None:  # logged as an ERROR already; the exit says it again
        print(f"python -m gpu_worker: the broker refused to register this worker: {worker.refused}",
              file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
