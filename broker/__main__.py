"""`python -m broker [--frontend EP] [--backend EP] [--config FILE.toml]`

Binds both endpoints (ipc:// under the runtime directory by default), prints one line
`READY frontend=<ep> backend=<ep>` on stdout once it serves (scripts and tests wait for that
line instead of sleeping), and exits 0 on SIGTERM or SIGINT.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from broker.server import Broker, BrokerConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m broker", description=__doc__.splitlines()[0])
    ap.add_argument("--frontend", help="client endpoint (default ipc://$XDG_RUNTIME_DIR/zmq-infer-UID/frontend.ipc)")
    ap.add_argument("--backend", help="worker endpoint (default ipc://.../backend.ipc)")
    ap.add_argument("--config", help="TOML file: frontend, backend and a [scheduler] table")
    ap.add_argument("--heartbeat-interval", type=float, help="seconds (default 1.0)")
    ap.add_argument("--heartbeat-liveness", type=int, help="missed heartbeats before a peer is dead (default 3)")
    ap.add_argument("--max-queue", type=int, help="queued requests per service (default 1024)")
    ap.add_argument("--service-grace", type=float, help="seconds a request waits for a worker of its service")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s broker %(levelname)s %(message)s")

    cfg = BrokerConfig.from_toml(args.config) if args.config else BrokerConfig()
    if args.frontend:
        cfg.frontend = args.frontend
    if args.backend:
        cfg.backend = args.backend
    for opt in ("heartbeat_interval", "heartbeat_liveness", "max_queue", "service_grace"):
        v = getattr(args, opt)
        if v is not None:
            setattr(cfg.scheduler, opt, v)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with Broker(cfg) as broker:
        print(f"READY frontend={broker.frontend_ep} backend={broker.backend_ep}", flush=True)
        broker.serve(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
