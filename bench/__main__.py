"""`python -m bench SUBCOMMAND`: run, latency, rate, sweep, compare, quick, render.

See docs/bench.md for the options, the JSON schema and the ratios."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from datetime import datetime, timezone
from typing import Any

try:  # the bench extra (hdrhistogram and the peers' clients): a line naming it, not a traceback
    import hdrh  # noqa: F401
except ImportError:
    sys.exit("python -m bench: needs the bench extra: pip install 'zmq-infer[bench]' (from a clone: "
             "pip install '.[bench]'; `make install` has it)")

from bench import loadgen, report as rep
from bench.loadgen import Measurement, PayloadSpec, RunConfig, Workload, parse_size
from bench.peers import PEERS, Peer, PeerClient, availability, load_plugins, make_peer, sigterm_exits

DEFAULT_SWEEP_SIZES = "16,256,4k,64k,1m,1080x1920x3,16m,64m"
DEFAULT_COMPARE_SIZES = "16,1080x1920x3,64m"
DEFAULT_SWEEP_CONCURRENCIES = "1,4,16"

# Per-subcommand timing defaults: (window_s, warmup_s, max_duration_s per workload).
TIMING = {
    "latency": (1.0, 0.5, 30.0),
    "rate": (1.0, 0.5, 30.0),
    "sweep": (0.5, 0.25, 10.0),
    "compare": (1.0, 0.5, 30.0),
    # quick must finish in < 2 min on 2 cores with five peers and three sizes.
    "quick": (0.25, 0.1, 10.0),
}


def default_single_peer() -> str:
    # Single-peer runs measure the broker; the floor stands in when its peers failed to load.
    return "broker-shm" if "broker-shm" in PEERS else "direct"


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _sizes(text: str) -> list[PayloadSpec]:
    try:
        return [parse_size(t) for t in _csv(text)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ints(text: str) -> list[int]:
    try:
        vals = [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return vals


def _floats(text: str) -> list[float]:
    try:
        vals = [float(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {text!r}") from None
    if not vals or any(not (0 < v < math.inf) for v in vals):  # (NaN fails this too)
        raise argparse.ArgumentTypeError(f"expected positive finite numbers: {text!r}")
    return vals


#: the most seconds a window, a warm-up, a run or a timeout may be: a day (as `run`'s)
_DAY_S = 86400.0


def _number(low: float, high: float, *, low_open: bool = False, integer: bool = False):
    """An argparse type: a finite number (an int with ``integer``) in [low, high] (low
    excluded with ``low_open``).  The peer subcommands took 0, negative and NaN values
    silently: a concurrency of 0 measured nothing and said "stable", a NaN timeout meant
    none (the bench audit)."""
    def parse(text: str):
        try:
            v = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if integer else 'a number'}: {text!r}") from None
        if not (low < v if low_open else low <= v) or not v <= high:  # (NaN fails both)
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: expected {'more than' if low_open else 'at least'} "
                                             f"{low:g} and at most {high:g}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("peers")
    g.add_argument("--peers", help="comma-separated peer names, or 'all' (registered: "
                   "see --list-peers)")
    g.add_argument("--peer-module", action="append", default=[], metavar="MODULE",
                   help="import MODULE to register more peers (repeatable)")
    g.add_argument("--list-peers", action="store_true", help="list peers and exit")
    t = common.add_argument_group("measurement")
    t.add_argument("--window-s", type=_number(0, _DAY_S, low_open=True), help="length of one measurement window")
    t.add_argument("--warmup-s", type=_number(0, _DAY_S), help="discarded warm-up window per peer (0: none)")
    t.add_argument("--max-duration-s", type=_number(0, _DAY_S, low_open=True),
                   help="stop repeating windows after this long, per workload (all peers)")
    t.add_argument("--stable-windows", type=_number(1, 1e6, integer=True), default=3,
                   help="consecutive windows whose p50s must agree (default 3)")
    t.add_argument("--tolerance", type=_number(0, 1e6, low_open=True), default=0.10,
                   help="relative p50 agreement that counts as stable (default 0.10)")
    t.add_argument("--min-requests", type=_number(1, 1e9, integer=True), default=3,
                   help="a closed-loop window runs past --window-s until this many were sent")
    t.add_argument("--timeout-s", type=_number(0, _DAY_S), default=30.0,
                   help="per-request timeout; a timed-out request is an error (default 30)")
    t.add_argument("--slo-ms", type=_number(0, _DAY_S * 1e3, low_open=True), default=10.0,
                   help="SLO threshold for attainment (default 10 ms)")
    t.add_argument("--seed", type=int, default=1, help="payload bytes and Poisson arrivals")
    t.add_argument("--spin-us", type=_number(0, 1e6), default=1000.0,
                   help="open loop: wait the last SPIN_US before each send by yielding instead "
                        "of a ~1 ms-grained timer (default 1000; 0 = timers only, less CPU)")
    o = common.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the JSON report")
    o.add_argument("--markdown", metavar="PATH", help="write a markdown table")
    o.add_argument("--plots", metavar="DIR", help="write PNG plots")
    o.add_argument("--quiet", action="store_true", help="no progress bar, no table")
    o.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")

    s = sub.add_parser("latency", parents=[common], help="closed loop at concurrency N")
    s.add_argument("--size", type=_sizes, default=_sizes("16"),
                   help="payload: bytes (16, 4k, 64m) or HxWxC uint8 (default 16)")
    s.add_argument("--concurrency", type=_number(1, 1e6, integer=True), default=1, help="requests in flight (default 1)")
    _add_blocking(s)

    s = sub.add_parser("rate", parents=[common],
                       help="open loop at R req/s, latency from intended send times")
    s.add_argument("--size", type=_sizes, default=_sizes("16"),
                   help="payload: bytes (16, 4k, 64m) or HxWxC uint8 (default 16)")
    s.add_argument("--rate", type=_number(0, 1e9, low_open=True), required=True, help="requests per second")
    s.add_argument("--arrival", choices=("constant", "poisson"), default="constant",
                   help="open-loop arrivals: evenly spaced or Poisson (default constant)")

    s = sub.add_parser("sweep", parents=[common], help="payload sizes x concurrencies")
    s.add_argument("--sizes", type=_sizes, default=_sizes(DEFAULT_SWEEP_SIZES),
                   help=f"comma-separated payloads (default {DEFAULT_SWEEP_SIZES})")
    s.add_argument("--concurrencies", type=_ints, default=None,
                   help=f"comma-separated (default {DEFAULT_SWEEP_CONCURRENCIES}; 1 with --blocking/--both)")
    s.add_argument("--rates", type=_floats,
                   help="sweep open-loop rates instead of concurrencies")
    s.add_argument("--arrival", choices=("constant", "poisson"), default="constant",
                   help="open-loop arrivals: evenly spaced or Poisson (default constant)")
    _add_blocking(s)

    for name, helptext in (("compare", "several peers, interleaved windows"),
                           ("quick", "a short compare (< 2 min on 2 cores)")):
        s = sub.add_parser(name, parents=[common], help=helptext)
        s.add_argument("--sizes", type=_sizes, default=_sizes(DEFAULT_COMPARE_SIZES),
                       help=f"comma-separated payloads (default {DEFAULT_COMPARE_SIZES})")
        s.add_argument("--concurrency", type=_number(1, 1e6, integer=True), default=1, help="closed-loop concurrency (default 1)")
        s.add_argument("--rate", type=_number(0, 1e9, low_open=True),
                       help="open loop at this rate instead of closed loop")
        s.add_argument("--arrival", choices=("constant", "poisson"), default="constant",
                   help="open-loop arrivals: evenly spaced or Poisson (default constant)")
        _add_blocking(s)

    sub.add_parser("run", help="your service on a running broker: closed/open loop or frame "
                               "streams, capacity under an SLO (python -m bench run --help)",
                   add_help=False)
    sub.add_parser("soak", help="long mixed 16 B / 6 MB load; RSS and open files per process "
                                "(python -m bench soak --help)", add_help=False)
    s = sub.add_parser("render", help="redraw table/markdown/plots from a saved JSON report")
    s.add_argument("report", help="JSON report written by --json")
    s.add_argument("--markdown", metavar="PATH")
    s.add_argument("--plots", metavar="DIR")
    s.add_argument("--csv", metavar="PATH", help="a `run` report only: perf_analyzer's CSV columns")
    s.add_argument("--quiet", action="store_true")
    return p


def _add_blocking(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("blocking clients (closed loop, concurrency 1)")
    g.add_argument("--blocking", action="store_true",
                   help="measure each peer through its blocking client (request_sync, no event "
                        "loop running), reported as PEER:sync, instead of its asyncio client")
    g.add_argument("--both", action="store_true",
                   help="measure each peer both ways: PEER (asyncio) and PEER:sync (blocking)")


def clients_mode(a: argparse.Namespace) -> str:
    """'asyncio' (the default), 'blocking' (--blocking) or 'both' (--both)."""
    if getattr(a, "both", False):
        return "both"
    return "blocking" if getattr(a, "blocking", False) else "asyncio"


def blocking_usage_error(a: argparse.Namespace) -> str | None:
    """Why --blocking/--both cannot run with these options (None when they can, or are off).
    A blocking client has one request in flight and no schedule: closed loop at concurrency 1."""
    if clients_mode(a) == "asyncio":
        return None
    flag = "--both" if a.both else "--blocking"
    if getattr(a, "rate", None) or getattr(a, "rates", None):
        return f"{flag} measures a closed loop: it cannot be combined with --rate/--rates"
    conc = getattr(a, "concurrencies", None) or [getattr(a, "concurrency", 1)]
    if any(c != 1 for c in conc):
        return (f"{flag} runs one request at a time: the concurrency must be 1, "
                f"not {','.join(map(str, conc))}")
    return None


def build_workloads(a: argparse.Namespace) -> list[Workload]:
    c = a.command
    if c == "latency":
        return [Workload(sz, "closed", concurrency=a.concurrency) for sz in a.size]
    if c == "rate":
        return [Workload(sz, "open", rate=a.rate, arrival=a.arrival) for sz in a.size]
    if c == "sweep":
        if a.rates:
            return [Workload(sz, "open", rate=r, arrival=a.arrival)
                    for sz in a.sizes for r in a.rates]
        concurrencies = a.concurrencies or (
            [1] if clients_mode(a) != "asyncio" else _ints(DEFAULT_SWEEP_CONCURRENCIES))
        return [Workload(sz, "closed", concurrency=n) for sz in a.sizes for n in concurrencies]
    if a.rate is not None:
        return [Workload(sz, "open", rate=a.rate, arrival=a.arrival) for sz in a.sizes]
    return [Workload(sz, "closed", concurrency=a.concurrency) for sz in a.sizes]


def resolve_peers(a: argparse.Namespace) -> list[str]:
    if a.peers and a.peers.strip() != "all":
        names = _csv(a.peers)
    elif a.peers or a.command in ("compare", "quick"):
        names = list(PEERS)
    else:
        names = [default_single_peer()]
    return list(dict.fromkeys(names))  # de-duplicate, keep order


def run_config(a: argparse.Namespace) -> RunConfig:
    window, warmup, max_d = TIMING[a.command]
    return RunConfig(
        window_s=a.window_s if a.window_s is not None else window,
        warmup_s=a.warmup_s if a.warmup_s is not None else warmup,
        max_duration_s=a.max_duration_s if a.max_duration_s is not None else max_d,
        stable_windows=a.stable_windows,
        tolerance=a.tolerance,
        min_requests=a.min_requests,
        timeout_s=a.timeout_s if a.timeout_s > 0 else None,
        seed=a.seed,
        spin_us=a.spin_us,
    )


class Progress:
    """tqdm bar over workloads, on stderr, only for a human watching (tty, not --quiet)."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="workload", file=sys.stderr, leave=False,
                            dynamic_ncols=True)

    def window(self, workload: str, peer: str, index: int) -> None:
        if self.bar is not None:
            w = "warm-up" if index < 0 else f"window {index + 1}"
            self.bar.set_postfix_str(f"{workload} | {peer} | {w}", refresh=True)

    def workload_done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def measure_all(peers: dict[str, Peer], workloads: list[Workload], cfg: RunConfig,
                      progress: Progress) -> list[Measurement]:
    clients = {}
    try:
        for n, p in peers.items():
            clients[n] = p.client()
        requests = {n: c.request for n, c in clients.items()}
        out: list[Measurement] = []
        payload, payload_spec = None, None
        for wl in workloads:
            if wl.payload != payload_spec:
                payload = None  # free a 64 MiB buffer before making the next one
                payload, payload_spec = loadgen.make_payload(wl.payload, cfg.seed), wl.payload
            ms = await loadgen.measure_interleaved(requests, payload, wl, cfg, progress.window)
            out.extend(ms.values())
            progress.workload_done()
        return out
    finally:
        for c in clients.values():
            try:
                await c.aclose()
            except Exception:
                pass


def has_request_sync(client: PeerClient) -> bool:
    return type(client).request_sync is not PeerClient.request_sync


def measure_mixed(peers: dict[str, Peer], variants: list[tuple[str, str, bool]],
                  workloads: list[Workload], cfg: RunConfig, progress: Progress,
                  use_uvloop: bool) -> tuple[list[Measurement], str, dict[str, str]]:
    """Measure `variants` ((label, peer, blocking) in interleaving order) with no event loop
    running during the blocking windows: the clients are made, and every asyncio window run,
    on one loop (asyncio.Runner) that stands still in between.  Returns the measurements,
    the loop's name and {label: reason} for blocking variants whose client has no
    request_sync."""
    runner, loop_name = loadgen.runner(use_uvloop)
    with runner:
        clients: dict[str, PeerClient] = {}
        try:
            async def make_clients() -> None:  # created inside the loop, as measure_all does
                for n, p in peers.items():
                    clients[n] = p.client()

            runner.run(make_clients())
            requests: dict[str, Any] = {}
            blocking: set[str] = set()
            skipped: dict[str, str] = {}
            for label, name, is_sync in variants:
                c = clients[name]
                if not is_sync:
                    requests[label] = c.request
                elif has_request_sync(c):
                    requests[label] = c.request_sync
                    blocking.add(label)
                else:
                    skipped[label] = (f"no blocking client: {type(c).__name__} does not "
                                      "implement request_sync")
            out: list[Measurement] = []
            payload, payload_spec = None, None
            for wl in workloads:
                if requests:
                    if wl.payload != payload_spec:
                        payload = None  # free a 64 MiB buffer before making the next one
                        payload, payload_spec = loadgen.make_payload(wl.payload, cfg.seed), wl.payload
                    ms = loadgen.measure_interleaved_sync(requests, payload, wl, cfg, progress.window,
                                                          blocking=blocking, run_async=runner.run)
                    out.extend(ms.values())
                progress.workload_done()
            return out, loop_name, skipped
        finally:
            for c in clients.values():
                try:
                    runner.run(c.aclose())
                except Exception:
                    pass




def run_loop(coro, use_uvloop: bool) -> tuple[Any, str]:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
                return r.run(coro), "uvloop"
    return asyncio.run(coro), "asyncio"


def _config_dict(a: argparse.Namespace, cfg: RunConfig, names: list[str],
                 workloads: list[Workload]) -> dict[str, Any]:
    return {
        "peers_requested": names,
        "workloads": [w.key for w in workloads],
        "sizes_bytes": sorted({w.payload.nbytes for w in workloads}),
        "concurrencies": sorted({w.concurrency for w in workloads if w.mode == "closed"}),
        "rates_rps": sorted({w.rate for w in workloads if w.mode == "open"}),
        "arrival": getattr(a, "arrival", None),
        "window_s": cfg.window_s,
        "warmup_s": cfg.warmup_s,
        "max_duration_s": cfg.max_duration_s,
        "stable_windows": cfg.stable_windows,
        "tolerance": cfg.tolerance,
        "min_requests": cfg.min_requests,
        "timeout_s": cfg.timeout_s,
        "seed": cfg.seed,
        "spin_us": cfg.spin_us,
        "slo_ms": a.slo_ms,
        "clients": clients_mode(a),                # asyncio | blocking | both
    }


def cmd_render(a: argparse.Namespace) -> int:
    why = rep.output_problem({"--markdown": a.markdown, "--csv": a.csv}, {"--plots": a.plots})
    if why:
        print(f"python -m bench render: error: {why}", file=sys.stderr)
        return 2
    try:
        with open(a.report) as f:
            report = json.load(f)
        from bench import run_report as rr

        if not (rr.is_run_report(report) or (isinstance(report, dict) and "peers" in report)):
            raise ValueError("not a report that --json wrote")
    except (OSError, ValueError) as e:  # (a traceback before: the bench audit)
        print(f"python -m bench render: error: cannot read {a.report}: {e}", file=sys.stderr)
        return 2

    if rr.is_run_report(report):
        if not a.quiet:
            print(rr.render_table(report))
        if a.markdown:
            rr.write_markdown(report, a.markdown)
        if a.csv:
            rr.write_csv(report, a.csv)
        if a.plots:
            rr.write_plots(report, a.plots)
        return 0
    if a.csv:
        print("python -m bench render: --csv needs a report of `python -m bench run`", file=sys.stderr)
        return 2
    if not a.quiet:
        print(rep.render_table(report))
    if a.markdown:
        rep.write_markdown(report, a.markdown)
    if a.plots:
        from bench import plots

        plots.write_plots(report, a.plots)
    return 0


def main(argv: list[str] | None = None) -> int:
    # The interpreter's own argv when run from a shell: exactly what was typed.
    argv_full = (list(sys.orig_argv) if argv is None
                 else [sys.executable, "-m", "bench", *argv])
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["soak"]:  # its own options (bench/soak.py): a run of the product, not of peers
        from bench import soak

        return soak.main(args[1:], from_shell=argv is None)
    if args[:1] == ["run"]:  # its own options (bench/run.py): a deployment that is already running
        from bench import run

        return run.main(args[1:], argv_full)
    a = build_parser().parse_args(argv)
    if a.command == "render":
        return cmd_render(a)
    why = blocking_usage_error(a) or rep.output_problem({"--json": a.json, "--markdown": a.markdown},
                                                        {"--plots": a.plots})
    if why:
        print(f"python -m bench {a.command}: error: {why}", file=sys.stderr)
        return 2
    mode = clients_mode(a)
    if argv is None:  # the command itself, not a caller of main() (whose handler it would replace for good)
        sigterm_exits()
    load_plugins(a.peer_module)
    names = resolve_peers(a)
    if a.list_peers:
        for n, (ok, why) in availability(list(PEERS)).items():
            print(f"{n:16s} {'available' if ok else 'unavailable: ' + why}  {PEERS[n].description}")
        return 0
    workloads = build_workloads(a)
    cfg = run_config(a)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t_start = time.monotonic()

    status: dict[str, dict] = {}
    running: dict[str, Peer] = {}
    progress = Progress(len(workloads), enabled=not a.quiet and sys.stderr.isatty())
    loop_name = None
    try:
        for name, (ok, why) in availability(names).items():
            desc = PEERS[name].description if name in PEERS else ""
            if not ok:
                status[name] = {"status": "skipped", "reason": why, "description": desc}
                continue
            peer = make_peer(name)
            try:
                peer.start()
            except Exception as e:
                peer.stop()
                status[name] = {"status": "failed", "reason": f"start failed: {e}",
                                "description": desc}
                continue
            except BaseException:  # Ctrl-C or SIGTERM while it started: stopped with the rest
                peer.stop()
                raise
            running[name] = peer
            status[name] = {"status": "ok", "reason": "", "description": desc}
            if mode != "asyncio":  # its blocking variant, right after it (table order)
                status[rep.sync_name(name)] = {"status": "ok", "reason": "",
                                               "description": f"{desc} (blocking client)"}
        measurements: list[Measurement] = []
        if running and mode == "asyncio":
            measurements, loop_name = run_loop(
                measure_all(running, workloads, cfg, progress), use_uvloop=not a.no_uvloop)
        elif running:
            variants = [(label, n, is_sync) for n in running
                        for label, is_sync in ((n, False), (rep.sync_name(n), True))
                        if (mode == "both" or is_sync)]
            measurements, loop_name, no_sync = measure_mixed(
                running, variants, workloads, cfg, progress, use_uvloop=not a.no_uvloop)
            for label, reason in no_sync.items():
                status[label].update(status="skipped", reason=reason)
    except KeyboardInterrupt:  # (a traceback before: the peers stopped, nothing reported)
        print(f"python -m bench {a.command}: interrupted; the peers are stopped, nothing is reported",
              file=sys.stderr)
        return 130
    finally:
        progress.close()
        for p in running.values():
            p.stop()

    report = rep.build_report(
        command=a.command, argv=argv_full, config=_config_dict(a, cfg, names, workloads),
        peers=status, measurements=measurements, slo_ms=a.slo_ms, started_at=started_at,
        wall_s=time.monotonic() - t_start, with_ratios=a.command in ("compare", "quick"),
        loop_name=loop_name)
    if not a.quiet:
        print(rep.render_table(report))
    if a.json:
        rep.write_json(report, a.json)
    if a.markdown:
        rep.write_markdown(report, a.markdown)
    if a.plots:
        from bench import plots

        plots.write_plots(report, a.plots)
    # Skipped peers are expected; having measured nothing at all is not.
    if mode == "blocking":  # only the blocking variants were to be measured
        return 0 if any(status[rep.sync_name(n)]["status"] == "ok" for n in running) else 1
    return 0 if running else 1


if __name__ == "__main__":
    sys.exit(main())
