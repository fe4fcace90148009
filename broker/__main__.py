"""`python -m broker [--frontend EP] [--backend EP] [--config FILE.toml]`

Binds both endpoints (ipc:// under the runtime directory by default), prints one line
`READY frontend=<ep> backend=<ep>` on stdout once it serves (scripts and tests wait for that
line instead of sleeping).  On SIGTERM or SIGINT it drains: nothing new goes to its workers,
what they hold is answered (`--drain-timeout-s` at most, 10 s by default), and it exits 0;
what is still queued goes with it, for its clients to send to the next broker (a restart);
another signal exits at once.

With `[[pool]]` tables in the `--config` file it is also their launcher (broker.launcher,
docs/operations.md "One launcher"): it starts and supervises those workers, its READY line
(`... workers=<n>`) waits for all of them, SIGTERM drains them before it exits 0, and SIGHUP
restarts them one at a time.  A bad key or value in the file is one line on stderr and exit 2.

A tcp endpoint is served with CurveZMQ: `--curve-secret FILE` (the broker's secret
certificate), `--client-keys DIR` and `--worker-keys DIR` (the allowed public certificates of
each side), or plain tcp with `--insecure` (a warning names the endpoint).  With a tcp
endpoint and neither, the broker does not start: it says what to pass and exits 2.

`python -m broker keys DIR [--name NAME]` writes a key pair, DIR/NAME.key (public) and
DIR/NAME.key_secret (secret, 0600), for the broker (NAME server, the default), a client or a
worker (docs/security.md).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import sys

from broker import protocol as P
from broker.config import check_launch, load_launcher
from broker.launcher import Launcher
from broker.protocol.heap import freeze_startup_heap
from broker.protocol.limits import MIN_NOFILE, raise_nofile_limit
from broker.protocol.logs import (
    add_log_options, announce, enable_crash_dumps, hold_std_descriptors, ignore_stop_signals, setup_logging,
    signal_wakeup_pipe, warn_from_signal,
)
from broker.protocol.naming import RuntimeDirError
from broker.protocol.pid1 import become_init_if_pid1
from broker.security import SecurityError, make_keys
from broker.server import Broker, BrokerConfig


def keys_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m broker keys",
                                 description="Write a CurveZMQ key pair: DIR/NAME.key (public) and "
                                             "DIR/NAME.key_secret (secret, mode 0600).")
    ap.add_argument("directory", metavar="DIR", help="where to write them (created 0700 if missing)")
    ap.add_argument("--name", default="server", help="file name: server (default), or e.g. client, worker, gpu-box-3")
    ap.add_argument("--force", action="store_true", help="overwrite an existing pair of that name")
    args = ap.parse_args(argv)
    try:
        public, secret = make_keys(args.directory, args.name, overwrite=args.force)
    except (SecurityError, OSError) as e:
        print(f"python -m broker keys: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"public {public}")
    print(f"secret {secret}")
    return 0


class _SignalStop:
    """The broker loop's stop flag, set from signal handlers: a plain attribute, no lock (a
    threading.Event's set() takes one, and a second signal arriving inside it deadlocks).

    ``wake_fd``: a pipe's read end that the C-level signal handler writes to
    (`signal.set_wakeup_fd`, `listen()`), which `Broker.serve` watches: the interpreter runs
    a Python handler only once the loop's wait returns (PEP 475 restarts it after EINTR,
    timeout and all), so a SIGTERM to an idle broker was seen at the end of its wait, up to
    100 ms later, where it now ends the wait at once."""

    def __init__(self, drain_s: float | None = None):
        self._set = False
        self.wake_fd: int | None = None
        self._write_fd: int | None = None
        # A standalone broker's first SIGTERM or SIGINT drains (`Broker._hold`: the loop ends
        # itself once its workers' requests are answered, ``drain_s`` at most); the next sets.
        self.drain_s = drain_s
        self.drain_asked = False

    def set(self) -> None:
        self._set = True

    def signalled(self, *_: object) -> None:
        if self.drain_s is not None and not self.drain_asked:
            self.drain_asked = True
        else:
            self._set = True

    def is_set(self) -> bool:
        return self._set

    def listen(self) -> None:
        pipe = signal_wakeup_pipe()
        if pipe is not None:  # (None: not the main thread; the loop sees the flag at its next pass)
            self.wake_fd, self._write_fd = pipe

    def close(self) -> None:
        if self.wake_fd is not None:
            signal.set_wakeup_fd(-1)
            os.close(self.wake_fd)
            os.close(self._write_fd)
            self.wake_fd = self._write_fd = None


def pool_worker_argv(config: str, pool: str) -> list[str]:
    """`python -m gpu_worker` flags of one worker of the `[[pool]]` named `pool` in the deploy
    file `config`, as the launcher starts it: the broker's backend and heartbeat settings,
    the pool's keys, `--insecure` for a plain tcp backend, then the pool's `extra_args`.
    Raises ValueError (one line to print) for a bad file or an unknown pool."""
    cfg = BrokerConfig.from_toml(config)
    deploy = load_launcher(config)
    pools = {p.name: p for p in (deploy.pools if deploy is not None else ())}
    if pool not in pools:
        raise ValueError(f"{config}: no [[pool]] named {pool!r} (pools: {', '.join(sorted(pools)) or 'none'})")
    backend = cfg.backend or P.default_endpoints()[1]
    host = backend.partition("://")[2].rpartition(":")[0]
    if backend.startswith("tcp://") and host in ("*", "0.0.0.0", "[::]", "::"):
        raise ValueError(f"{config}: backend {backend!r} is where the broker binds, not an address a worker can "
                         "connect to: give the worker one after `--` (-- --broker tcp://HOST:PORT)")
    link = ("--insecure",) if backend.startswith("tcp://") and cfg.security.insecure else ()
    return pools[pool].worker_args(backend, heartbeat_interval=cfg.scheduler.heartbeat_interval,
                                   heartbeat_liveness=cfg.scheduler.heartbeat_liveness, link=link)


def pool_main(argv: list[str]) -> int:
    """`python -m broker --config FILE --pool NAME [-- WORKER FLAGS]`: become one worker of that
    pool (exec `python -m gpu_worker`), for a worker in a container or Deployment of its own
    beside a broker reading the same file; flags after `--` override the file's."""
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, rest = argv[:cut], argv[cut + 1:]
    config = pool = None
    i = 0
    while i < len(ours):  # only --config and --pool here: the worker's flags go after --
        a = ours[i]
        key, eq, val = a.partition("=")
        if key in ("--config", "--pool") and (eq or i + 1 < len(ours)):
            if not eq:
                i += 1
                val = ours[i]
            if key == "--config":
                config = val
            else:
                pool = val
        else:
            print(f"python -m broker: with --pool, only --config FILE and --pool NAME come before `--`; "
                  f"the worker's flags (such as {a}) go after it", file=sys.stderr, flush=True)
            return 2
        i += 1
    if not config or not pool:
        print("python -m broker: --pool NAME needs --config FILE (the deploy file with that [[pool]])",
              file=sys.stderr, flush=True)
        return 2
    try:
        args = pool_worker_argv(config, pool)
    except (SecurityError, ValueError, OSError) as e:  # config.ConfigError too: one line naming the key
        print(f"python -m broker: {e}", file=sys.stderr, flush=True)
        return 2
    sys.stdout.flush()
    # The interpreter's own options (-X, -u, ...) carry over: everything before our `-m broker`.
    orig = list(getattr(sys, "orig_argv", [sys.executable]))
    lead = orig[:orig.index("-m")] if "-m" in orig else [sys.executable]
    os.execv(sys.executable, [*lead, "-m", "gpu_worker", *args, *rest])
    return 0  # pragma: no cover - execv does not return


#: how long a standalone broker's SIGTERM waits at most for what its workers hold
#: (`--drain-timeout-s`): under the 10 s docker stop gives before its SIGKILL
DRAIN_TIMEOUT_S = 8.0

#: each numeric flag's range (the deploy file's keys have theirs: broker.state.Scheduler.check,
#: broker.server.LIMITS): NaN, infinities and huge values passed and crashed the broker later,
#: and silly small ones were clamped into something else (the command-line hunt)
_RANGES = {
    "heartbeat_interval": ("--heartbeat-interval", 0.001, 3600),
    "heartbeat_liveness": ("--heartbeat-liveness", 2, 1000),
    "drain_timeout_s": ("--drain-timeout-s", 0, 1e6),
    "max_queue": ("--max-queue", 0, 1 << 31),
    "service_grace": ("--service-grace", 0, 86400),
    "max_retries": ("--max-retries", 0, 100),
    "max_frame_mb": ("--max-frame-mb", 0.0625, 1 << 20),
    "max_reply_mb": ("--max-reply-mb", 0.0625, 1 << 22),
    "client_hwm": ("--client-hwm", 1, (1 << 31) - 1),
    "max_client_requests": ("--max-client-requests", 1, 1 << 31),
    # (more than 0: a byte at least, _check_ranges)
    "max_client_mb": ("--max-client-mb", 0, 1 << 30),
    "max_total_mb": ("--max-total-mb", 0, 1 << 30),
    "max_unread_mb": ("--max-unread-mb", 0.0625, 1 << 30),
    "recall_after_ms": ("--recall-after-ms", -math.inf, 86400e3),
    "lifo_after_ms": ("--lifo-after-ms", -math.inf, 86400e3),
    "lifo_miss_ms": ("--lifo-miss-ms", -math.inf, 86400e3),
}


def _check_ranges(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A numeric flag out of its range, or not finite: one usage line naming it, exit 2.
    An empty endpoint too: `--frontend "$FE"` with FE unset bound the default endpoint, where
    another broker of the user may serve."""
    for flag in ("frontend", "backend"):
        v = getattr(args, flag, None)
        if v is not None and not v.strip():
            ap.error(f"--{flag} is empty (leave it out for the default endpoint)")
    # The same slip with --http turned metrics and health off, over the file's `http` too,
    # without a word (a readiness probe then never passes).
    http = getattr(args, "http", None)
    if http is not None and not http.strip():
        ap.error("--http is empty (leave it out for the deploy file's `http`, or no /metrics and /v2/health)")
    for key, (flag, lo, hi) in _RANGES.items():
        v = getattr(args, key, None)
        if v is None:
            continue
        if not (math.isfinite(v) or (v == -math.inf and lo == -math.inf)) or not lo <= v <= hi:
            ap.error(f"{flag} must be from {_num(lo)} to {_num(hi)}, not {v}" if lo > -math.inf else
                     f"{flag} must be a number up to {_num(hi)} (negative: never), not {v}")
    total = getattr(args, "max_total_mb", None)
    if total is not None and int(total * (1 << 20)) < 1:
        ap.error(f"--max-total-mb must be more than 0, at most {_num(_RANGES['max_total_mb'][2])}, not {total}")
    mb = getattr(args, "max_client_mb", None)
    if mb is not None and int(mb * (1 << 20)) < 1:
        # 0 is not "no limit": it refused every request with an inline tensor (the small ones
        # a shared-memory client sends inline too) with "wait for results" (the configuration hunt)
        ap.error(f"--max-client-mb must be more than 0, at most {_num(_RANGES['max_client_mb'][2])} (0 is not "
                 f"'no limit': it would refuse every request with an inline tensor), not {mb}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        # pid 1 of a container: a default signal action does nothing there, and orphans are
        # ours to reap; an init takes that place and runs us again as pid 2 (pid1.py)
        become_init_if_pid1()
    hold_std_descriptors()  # a closed stderr's number must not go to a socket we then write "stderr" into
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["keys"]:
        return keys_main(argv[1:])
    if any(a == "--pool" or a.startswith("--pool=") for a in argv[: argv.index("--") if "--" in argv else None]):
        return pool_main(argv)
    # No abbreviations, as the worker takes none: `--front` for `--frontend` read as a typo
    # in one and as the flag in the other (the command-line hunt).
    ap = argparse.ArgumentParser(prog="python -m broker", description=__doc__.splitlines()[0], allow_abbrev=False,
                                 epilog="python -m broker keys DIR [--name NAME]: write a CurveZMQ key pair; "
                                        "python -m broker --config FILE --pool NAME [-- FLAGS]: run one worker "
                                        "of that [[pool]] (docs/operations.md)")
    ap.add_argument("--frontend", help="client endpoint (default ipc://$XDG_RUNTIME_DIR/zmq-infer-UID/frontend.ipc)")
    ap.add_argument("--backend", help="worker endpoint (default ipc://.../backend.ipc)")
    ap.add_argument("--config", help="TOML file: frontend, backend, a [scheduler] and a [security] table; "
                                     "with [[pool]] tables, also starts and supervises those workers")
    ap.add_argument("--heartbeat-interval", type=float, help="seconds (default 1.0)")
    ap.add_argument("--heartbeat-liveness", type=int, help="missed heartbeats before a peer is dead (default 3)")
    ap.add_argument("--max-queue", type=int, help="queued requests per service (default 1024)")
    ap.add_argument("--service-grace", type=float, help="seconds a request waits for a worker of its service (default 1.0)")
    ap.add_argument("--max-retries", type=int,
                    help="times a request is dispatched again after its worker died before it fails with "
                         "WORKER_FAILED (default 2)")
    ap.add_argument("--max-frame-mb", type=float,
                    help="largest frame a client may send, MiB (default 256); a larger one drops its connection")
    ap.add_argument("--max-reply-mb", type=float,
                    help="largest frame a worker may send over a tcp backend, MiB (default 4 x --max-frame-mb, "
                         "1024 at least: what a peer can make the broker buffer before its handshake); a larger "
                         "one drops the worker's connection.  Ipc backends: no limit")
    ap.add_argument("--client-hwm", type=int,
                    help="messages queued towards one client before it counts as not reading and is dropped "
                         "(default: --max-client-requests, at least 4096)")
    ap.add_argument("--max-client-requests", type=int,
                    help="outstanding requests per client, across services (default 4096)")
    ap.add_argument("--max-client-mb", type=float,
                    help="MiB of requests (headers and inline tensors) one client may have queued or running, "
                         "and of big replies waiting for it unread (default 512)")
    ap.add_argument("--max-total-mb", type=float,
                    help="MiB of requests (headers and inline tensors) all clients together may have queued or "
                         "running (default: half the memory the broker may use, its cgroup's limit or the "
                         "machine's); over it a request is refused QUEUE_FULL")
    ap.add_argument("--max-unread-mb", type=float,
                    help="MiB of big replies all clients together may have waiting unread (default: a quarter of "
                         "the memory the broker may use); over it the reader holding the most, of those that read "
                         "none of theirs for a second (longer for a big frame), is dropped as one that stopped reading (past twice it, the "
                         "one holding the most)")
    ap.add_argument("--http", metavar="HOST:PORT",
                    help="serve /metrics (Prometheus) and the /v2/health and /v2/models paths here "
                         "(PORT alone: 127.0.0.1); off by default, and then nothing is counted")
    ap.add_argument("--drain-timeout-s", type=float,
                    help="a broker without [[pool]] tables, on SIGTERM or SIGINT: dispatch nothing new, wait this "
                         f"long at most for the requests its workers hold, then exit (queued requests go with it, "
                         f"for their clients to send to the next broker); another signal exits at once; 0: exit at "
                         f"once (default {DRAIN_TIMEOUT_S:g}: under docker stop's 10 s; a launcher drains for its "
                         f"file's [launcher] drain_timeout_s)")
    ap.add_argument("--recall-after-ms", type=float,
                    help="an idle worker takes back requests waiting behind a busy worker's batch once that "
                         "batch has run this long (default 5; negative: never)")
    ap.add_argument("--lifo-after-ms", type=float,
                    help="once a service's queue has not emptied for this long, and one of its requests missed "
                         "its deadline (--lifo-miss-ms), it serves each client's newest requests first (default "
                         "100; negative: never)")
    ap.add_argument("--lifo-miss-ms", type=float,
                    help="a missed deadline counts for --lifo-after-ms this long (default 100; negative: a queue "
                         "that has not emptied serves newest first whatever its deadlines)")
    ap.add_argument("--curve-secret", metavar="FILE", help="tcp endpoints: the broker's secret certificate (NAME.key_secret)")
    ap.add_argument("--client-keys", metavar="DIR", help="tcp frontend: directory of allowed clients' public *.key certificates")
    ap.add_argument("--worker-keys", metavar="DIR", help="tcp backend: directory of allowed workers' public *.key certificates")
    ap.add_argument("--insecure", action="store_true", help="serve tcp endpoints as plain tcp: no authentication, no encryption")
    add_log_options(ap)
    args = ap.parse_args(argv)
    _check_ranges(ap, args)
    setup_logging(args.log_level, args.log_format, "broker")
    # A crash in native code (a model's extension on one input, libzmq's assertions): every
    # thread's Python stack on stderr, written at once (log lines still queued for the
    # writer thread may not get out), and never blocked by a stderr nobody reads.
    enable_crash_dumps()

    try:
        cfg = BrokerConfig.from_toml(args.config) if args.config else BrokerConfig()
        deploy = load_launcher(args.config) if args.config else None  # [[pool]] tables, if any
        if deploy is not None:
            # what only the launcher cannot run (a fixed port in extra_args, flags the locale cannot pass)
            check_launch(deploy, cfg.backend or "")
    except (SecurityError, ValueError) as e:  # config.ConfigError too: one line naming the key
        print(f"python -m broker: {e}", file=sys.stderr, flush=True)
        return 2
    if args.frontend:
        cfg.frontend = args.frontend
    if args.backend:
        cfg.backend = args.backend
    for key in ("frontend", "backend"):
        ep = getattr(cfg, key) or ""
        if ep.strip().lower().startswith("inproc://"):
            # (the file's too: a broker that printed READY there, which no other process can reach)
            print(f"python -m broker: {key} {ep}: an inproc:// endpoint is reachable only from inside this process; "
                  f"use ipc:// or tcp://", file=sys.stderr, flush=True)
            return 2
    if args.drain_timeout_s is not None and deploy is not None:
        print("python -m broker: --drain-timeout-s is for a broker without [[pool]] tables; a launcher drains for its "
              "file's [launcher] drain_timeout_s", file=sys.stderr, flush=True)
        return 2
    for opt in ("heartbeat_interval", "heartbeat_liveness", "max_queue", "service_grace", "max_retries"):
        v = getattr(args, opt)
        if v is not None:
            setattr(cfg.scheduler, opt, v)
    if args.max_frame_mb is not None:
        cfg.max_frame_bytes = int(args.max_frame_mb * (1 << 20))  # (in range: _check_ranges)
    if args.max_reply_mb is not None:
        cfg.max_reply_frame_bytes = int(args.max_reply_mb * (1 << 20))
    if args.client_hwm is not None:
        cfg.client_hwm = args.client_hwm
    if args.max_client_requests is not None:
        cfg.scheduler.max_client_requests = args.max_client_requests
    if args.max_client_mb is not None:
        cfg.scheduler.max_client_bytes = int(args.max_client_mb * (1 << 20))
    if args.max_total_mb is not None:
        cfg.scheduler.max_total_bytes = int(args.max_total_mb * (1 << 20))
    if args.max_unread_mb is not None:
        cfg.max_unread_bytes = int(args.max_unread_mb * (1 << 20))
    if args.http is not None:
        cfg.http = args.http
    if args.recall_after_ms is not None:
        cfg.scheduler.recall_after = None if args.recall_after_ms < 0 else args.recall_after_ms / 1000.0
    if args.lifo_after_ms is not None:
        cfg.scheduler.lifo_after = None if args.lifo_after_ms < 0 else args.lifo_after_ms / 1000.0
    if args.lifo_miss_ms is not None:
        cfg.scheduler.lifo_miss_window = None if args.lifo_miss_ms < 0 else args.lifo_miss_ms / 1000.0
    for opt in ("curve_secret", "client_keys", "worker_keys"):
        v = getattr(args, opt)
        if v is not None:
            setattr(cfg.security, opt, v)
    if args.insecure:
        cfg.security.insecure = True

    soft, _ = raise_nofile_limit()  # a descriptor per client connection (broker.protocol.limits)
    if 0 < soft < MIN_NOFILE:
        logging.getLogger("broker").warning(
            "the descriptor limit is %d (its hard limit too): under %d, clients connecting all at once (after a "
            "restart, say) can take the last descriptors before the broker stops accepting, and libzmq then "
            "aborts it; raise it (ulimit -n; LimitNOFILE= in a systemd unit; --ulimit nofile= for a container)",
            soft, MIN_NOFILE)
    try:
        broker = Broker(cfg)
    except (SecurityError, RuntimeDirError, ValueError, RuntimeError) as e:
        print(f"python -m broker: {e}", file=sys.stderr, flush=True)
        return 2
    # Standalone, the first signal drains (a launcher drains its own way: it takes the signals
    # over); a drain of 0 s is none: it stops at once, as before.
    drain_s = DRAIN_TIMEOUT_S if args.drain_timeout_s is None else args.drain_timeout_s
    stop = _SignalStop(drain_s if deploy is None and drain_s else None)
    signal.signal(signal.SIGTERM, stop.signalled)
    signal.signal(signal.SIGINT, stop.signalled)
    stop.listen()
    if deploy is None:
        # SIGHUP rolls a launcher's pools; here there are none.  Its default action ended the
        # broker at once, with no drain.
        # Said through the log's writer thread: a handler that wrote to stderr itself
        # blocked the loop for good when stderr was a pipe nobody read.
        signal.signal(signal.SIGHUP, lambda *_: warn_from_signal(
            "broker", "SIGHUP ignored (it rolls the worker pools of a --config with [[pool]] tables; this broker "
                      "has none)"))
    # SIGUSR1 and SIGUSR2 (a logrotate postrotate habit, an operator after a stack dump):
    # their default action ended the broker at once, with no drain and no line on stderr,
    # and with it every request in flight.  Logs go to stderr, so there is nothing to reopen.
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda n, _f: warn_from_signal(
            "broker", f"{signal.Signals(n).name} ignored (logs go to stderr: there is no log file to reopen; "
                      "SIGTERM drains and stops the broker, SIGHUP rolls a launcher's pools)"))
    # [[pool]] tables: this process is their launcher too (broker.launcher).  It takes the
    # signals over (SIGTERM drains the pools, then sets `stop`; SIGHUP rolls them) and prints
    # READY itself once every pool's workers are ready.
    pools = Launcher(broker, deploy, stop) if deploy is not None else None
    freeze_startup_heap()  # startup is over: keep full collections short (broker.protocol.heap)
    with broker, (pools if pools is not None else contextlib.nullcontext()):
        http = f" http={broker.http_address}" if broker.http is not None else ""
        if pools is None:
            announce(f"READY frontend={broker.frontend_ep} backend={broker.backend_ep}{http}")
        broker.serve(stop)
    # Stopped (and the pools' workers gone): a signal from now on has nothing left to hurry.
    # Ignored, because the interpreter's exit puts the default actions back, and a SIGTERM
    # during it (a second one sent just after the first) ended the process with -15, not 0.
    ignore_stop_signals()
    stop.close()
    return 0 if pools is None else pools.exit_code


if __name__ == "__main__":
    sys.exit(main())
