"""Turn measurements into the report: a JSON document (schema in docs/bench.md), a terminal
table and a markdown table. Pure functions of the data, so tests can build reports from
synthetic measurements."""
from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # bench.loadgen needs hdrh, which the one-shot benches' GPU image lacks
    from bench.loadgen import Measurement

SCHEMA = "zinf-bench/1"

FRAME_SHAPE = (1080, 1920, 3)  # one 1080p RGB frame, 6,220,800 bytes
TINY_BYTES = 16
FRAME_BYTES = int(FRAME_SHAPE[0] * FRAME_SHAPE[1] * FRAME_SHAPE[2])  # 6,220,800
BIG_BYTES = 64 << 20

# name -> (numerator (peer, bytes), denominator (peer, bytes), meaning)
RATIOS: dict[str, tuple[tuple[str, int], tuple[str, int], str]] = {
    "broker_vs_proxy_floor_tiny": (
        ("broker-shm", TINY_BYTES), ("proxy-sdk", TINY_BYTES),
        "p50 at 16 B through broker-shm / p50 of the same SDK client and gpu_worker echo "
        "with a libzmq proxy in place of the broker"),
    "broker_vs_bare_proxy_tiny": (
        ("broker-shm", TINY_BYTES), ("proxy", TINY_BYTES),
        "p50 at 16 B through broker-shm / p50 of a raw DEALER client through a libzmq proxy "
        "to a minimal echo"),
    "proxy_sdk_vs_proxy_tiny": (
        ("proxy-sdk", TINY_BYTES), ("proxy", TINY_BYTES),
        "p50 at 16 B of proxy-sdk / proxy: what the SDK client and gpu_worker cost over a raw "
        "DEALER and a minimal echo, behind the same proxy"),
    "broker_vs_direct_tiny": (
        ("broker-shm", TINY_BYTES), ("direct", TINY_BYTES),
        "p50 at 16 B through broker-shm / p50 of a direct DEALER-ROUTER echo"),
    "payload_independence_6mb": (
        ("broker-shm", FRAME_BYTES), ("broker-shm", TINY_BYTES),
        "broker-shm p50 at 1080x1920x3 uint8 (6.2 MB) / its p50 at 16 B"),
    "payload_independence_64mb": (
        ("broker-shm", BIG_BYTES), ("broker-shm", TINY_BYTES),
        "broker-shm p50 at 64 MiB / its p50 at 16 B"),
    "pinned_vs_direct_tiny": (
        ("pinned", TINY_BYTES), ("direct", TINY_BYTES),
        "p50 at 16 B of the pinned path (SDK client with pin=True, gpu_worker --direct: two hops) / "
        "p50 of a raw DEALER-ROUTER echo"),
    "pinned_vs_grpc_tiny": (
        ("pinned", TINY_BYTES), ("grpc", TINY_BYTES),
        "p50 at 16 B of the pinned path / p50 of a gRPC bidi stream echo"),
    "pinned_payload_independence_6mb": (
        ("pinned", FRAME_BYTES), ("pinned", TINY_BYTES),
        "pinned p50 at 1080x1920x3 uint8 (6.2 MB) / its p50 at 16 B"),
    "pinned_payload_independence_64mb": (
        ("pinned", BIG_BYTES), ("pinned", TINY_BYTES),
        "pinned p50 at 64 MiB / its p50 at 16 B"),
    "pinned_link_vs_ipc_tiny": (
        ("pinned", TINY_BYTES), ("pinned-ipc", TINY_BYTES),
        "p50 at 16 B of the pinned path over the worker's local link / over its ipc direct socket "
        "(pinned-ipc: --no-link)"),
    "grpc_vs_shm_6mb": (
        ("grpc", FRAME_BYTES), ("broker-shm", FRAME_BYTES),
        "grpc p50 / broker-shm p50 at 1080x1920x3 uint8 (6.2 MB)"),
}

# A peer measured through its blocking client (`--blocking`, `--both`) is reported as
# "<peer>:sync".  Every ratio above has a `<name>_sync` twin, the same definition over the
# blocking results: what the targets are about, with the asyncio ones beside them.
SYNC_SUFFIX = ":sync"


def sync_name(peer: str) -> str:
    return peer + SYNC_SUFFIX


SYNC_RATIOS: dict[str, tuple[tuple[str, int], tuple[str, int], str]] = {
    f"{name}_sync": ((sync_name(pn), bn), (sync_name(pd), bd),
                     f"{meaning}; blocking clients (the :sync results)")
    for name, ((pn, bn), (pd, bd), meaning) in RATIOS.items()
}

# name -> ((peer, bytes), meaning): p99 / p50 of one result, blocking clients, sequential.
TAIL_RATIOS: dict[str, tuple[tuple[str, int], str]] = {
    "tail_ratio_tiny": (
        (sync_name("broker-shm"), TINY_BYTES),
        "p99 / p50 of broker-shm:sync at 16 B: the tail of a lone sequential blocking client "
        "on the default brokered path"),
    "tail_ratio_floor_tiny": (
        (sync_name("proxy-sdk"), TINY_BYTES),
        "p99 / p50 of proxy-sdk:sync at 16 B: the same for the brokered floor (same client and "
        "worker, a libzmq proxy in place of the broker)"),
}

# name -> (numerator ratio, denominator ratio, meaning)
QUOTIENT_RATIOS: dict[str, tuple[str, str, str]] = {
    "tail_ratio_vs_floor_tiny": (
        "tail_ratio_tiny", "tail_ratio_floor_tiny",
        "tail_ratio_tiny / tail_ratio_floor_tiny: how much wider the broker's tail is than "
        "the floor's own"),
}


def ratio_definitions(blocking: bool = False) -> dict[str, str]:
    """What each reported ratio means; with `blocking`, the blocking-client ratios too."""
    out = {k: v[2] for k, v in RATIOS.items()}
    if blocking:
        out.update({k: v[2] for k, v in SYNC_RATIOS.items()})
        out.update({k: v[1] for k, v in TAIL_RATIOS.items()})
        out.update({k: v[2] for k, v in QUOTIENT_RATIOS.items()})
    return out


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(loop_name: str | None = None) -> dict[str, Any]:
    import zmq

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        usable = os.cpu_count()
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "machine": platform.machine(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "pyzmq": zmq.pyzmq_version(),
        "libzmq": zmq.zmq_version(),
        "numpy": _version("numpy"),
        "grpcio": _version("grpcio"),
        "hdrhistogram": _version("hdrhistogram"),
        "uvloop": _version("uvloop"),
        "event_loop": loop_name,
    }


def _r(x: float | None, nd: int = 3) -> float | None:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return round(x, nd)


def result_entry(m: Measurement, slo_ms: float | None) -> dict[str, Any]:
    wl = m.workload
    attempts = m.ok + m.errors
    slo = None
    if slo_ms is not None and attempts:
        # Failed requests count as misses: an error never meets an SLO.
        slo = m.hist.count_at_or_below_ms(slo_ms) / attempts
    rps = m.ok / m.elapsed_s if m.elapsed_s > 0 else None
    entry = {
        "peer": m.peer,
        "workload": wl.key,
        "payload_bytes": wl.payload.nbytes,
        "payload_label": wl.payload.label,
        "payload_shape": list(wl.payload.shape),
        "mode": wl.mode,
        "concurrency": wl.concurrency if wl.mode == "closed" else None,
        "rate_rps": wl.rate if wl.mode == "open" else None,
        "arrival": wl.arrival if wl.mode == "open" else None,
        "requests": m.ok,
        "errors": m.errors,
        "timeouts": m.timeouts,
        "error_samples": list(m.error_samples),
        "measured_s": _r(m.elapsed_s),
        "throughput_rps": _r(rps, 2),
        "throughput_MBps": _r(rps * wl.payload.nbytes / 1e6, 2) if rps is not None else None,
        "latency_ms": {k: _r(v) for k, v in m.hist.summary_ms().items()},
        "slo_ms": slo_ms,
        "slo_attainment": _r(slo, 5),
        "server_ms": m.server.means_ms(),
        "server_samples": m.server.samples,
        "windows": len(m.window_p50_ms),
        "window_p50_ms": [_r(v) for v in m.window_p50_ms],
        "converged": m.converged,
        "max_send_lag_ms": _r(m.max_send_lag_ms) if wl.mode == "open" else None,
        "hdr": m.hist.encode() if m.hist.count else None,
    }
    if m.blocking:  # only on blocking results, so asyncio entries keep their schema
        entry["blocking"] = True
    return entry


def _lookup(results: list[dict], peers: dict[str, dict], peer: str, nbytes: int,
            stat: str = "p50") -> tuple[float | None, str]:
    st = peers.get(peer)
    if st is None and peer.endswith(SYNC_SUFFIX):
        # A blocking variant has no entry of its own when its peer never ran, or when the
        # run measured only the asyncio clients: say which.
        base = peers.get(peer[:-len(SYNC_SUFFIX)])
        if base is not None and base["status"] != "ok":
            return None, f"peer {peer[:-len(SYNC_SUFFIX)]!r} {base['status']}: {base['reason']}"
        if base is not None:
            return None, (f"peer {peer!r} was not measured (blocking clients: run with "
                          "--blocking or --both)")
    if st is None:
        return None, f"peer {peer!r} was not part of this run"
    if st["status"] != "ok":
        return None, f"peer {peer!r} {st['status']}: {st['reason']}"
    rows = [r for r in results if r["peer"] == peer and r["payload_bytes"] == nbytes
            and r["mode"] == "closed"]
    if not rows:
        if not any(r["peer"] == peer for r in results) and sync_name(peer) in peers:
            return None, (f"only the blocking client of {peer!r} was measured "
                          "(--blocking; --both measures both)")
        return None, f"peer {peer!r} was not measured at {nbytes} B (closed loop)"
    # Ratios are about unloaded latency: use the lowest concurrency measured.
    row = min(rows, key=lambda r: r["concurrency"])
    p50 = row["latency_ms"]["p50"]
    if p50 is None or p50 <= 0:
        return None, f"peer {peer!r} has no successful request at {nbytes} B"
    if stat == "p50":
        return p50, ""
    v = row["latency_ms"].get(stat)
    if v is None:
        return None, f"peer {peer!r} has no {stat} at {nbytes} B"
    return v, ""


def _lookup_p50(results: list[dict], peers: dict[str, dict], peer: str, nbytes: int
                ) -> tuple[float | None, str]:
    return _lookup(results, peers, peer, nbytes)


def has_blocking(peers: dict[str, dict]) -> bool:
    """Whether a run asked for blocking clients (its peers include `<peer>:sync` entries)."""
    return any(n.endswith(SYNC_SUFFIX) for n in peers)


def compute_ratios(results: list[dict], peers: dict[str, dict], blocking: bool | None = None
                   ) -> tuple[dict[str, float | None], dict[str, str]]:
    """The ratios of RATIOS, and with `blocking` (default: whether `peers` has `:sync`
    entries) those of SYNC_RATIOS, TAIL_RATIOS and QUOTIENT_RATIOS; a null ratio's reason
    is in the second dict."""
    if blocking is None:
        blocking = has_blocking(peers)
    ratios: dict[str, float | None] = {}
    missing: dict[str, str] = {}
    exact: dict[str, float] = {}  # unrounded, for the quotients
    p50_ratios = {**RATIOS, **SYNC_RATIOS} if blocking else RATIOS
    for name, ((pn, bn), (pd, bd), _meaning) in p50_ratios.items():
        num, why_n = _lookup(results, peers, pn, bn)
        den, why_d = _lookup(results, peers, pd, bd)
        if num is None or den is None:
            ratios[name] = None
            missing[name] = "; ".join(dict.fromkeys(w for w in (why_n, why_d) if w))
        else:
            ratios[name] = round(num / den, 4)
    if not blocking:
        return ratios, missing
    for name, ((peer, nbytes), _meaning) in TAIL_RATIOS.items():
        num, why_n = _lookup(results, peers, peer, nbytes, "p99")
        den, why_d = _lookup(results, peers, peer, nbytes, "p50")
        if num is None or den is None:
            ratios[name] = None
            missing[name] = "; ".join(dict.fromkeys(w for w in (why_n, why_d) if w))
        else:
            exact[name] = num / den
            ratios[name] = round(exact[name], 4)
    for name, (rn, rd, _meaning) in QUOTIENT_RATIOS.items():
        if rn in exact and rd in exact:
            ratios[name] = round(exact[rn] / exact[rd], 4)
        else:
            ratios[name] = None
            missing[name] = "; ".join(f"{r}: {missing[r]}" for r in (rn, rd) if r in missing)
    return ratios, missing


def build_report(*, command: str, argv: list[str], config: dict[str, Any],
                 peers: dict[str, dict], measurements: list[Measurement],
                 slo_ms: float | None, started_at: str, wall_s: float,
                 with_ratios: bool, loop_name: str | None = None) -> dict[str, Any]:
    """`peers`: name -> {"status": "ok"|"skipped"|"failed", "reason": str, "description": str}."""
    results = [result_entry(m, slo_ms) for m in measurements]
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "command": command,
        "argv": list(argv),
        "command_line": " ".join(shlex.quote(a) for a in argv),
        "started_at": started_at,
        "wall_s": round(wall_s, 3),
        "machine": machine_info(loop_name),
        "config": config,
        "peers": peers,
        "skipped": [{"peer": n, "status": s["status"], "reason": s["reason"]}
                    for n, s in peers.items() if s["status"] != "ok"],
        "results": results,
    }
    if with_ratios:
        blocking = has_blocking(peers)
        ratios, missing = compute_ratios(results, peers, blocking)
        report["ratios"] = ratios
        report["ratios_missing"] = missing
        report["ratio_definitions"] = ratio_definitions(blocking)
    return report


def _nearest_existing(path: str) -> str:
    d = os.path.abspath(path)
    while not os.path.exists(d):
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return d


def output_problem(files: dict[str, str | None], dirs: dict[str, str | None]) -> str | None:
    """Why one of the outputs cannot be written (``files``: flag -> a file's path, ``dirs``:
    flag -> a folder's), as one line naming the flag; None when each can.  Checked before a
    run measures anything: a run of minutes lost at the end to a mistyped path is what this
    saves."""
    wanted = []  # (flag, path, the folder it goes in)
    for flag, path in files.items():
        if not path:
            continue
        if os.path.isdir(path):
            return f"{flag} {path}: is a directory; give a file's path"
        if os.path.exists(path) and not os.access(path, os.W_OK):
            return f"{flag} {path}: not writable"
        wanted.append((flag, path, os.path.dirname(os.path.abspath(path))))
    wanted += [(flag, path, path) for flag, path in dirs.items() if path]
    for flag, path, folder in wanted:
        d = _nearest_existing(folder)
        if not os.path.isdir(d):
            return f"{flag} {path}: {d} is not a directory"
        if not os.access(d, os.W_OK | os.X_OK):
            return f"{flag} {path}: {d} is not writable"
    return None


def write_json(report: dict[str, Any], path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, allow_nan=False)
        f.write("\n")


def print_and_save(res: dict[str, Any], path: str | None) -> int:
    """A one-shot bench's result: the machine added, printed as JSON, also written to
    ``path`` when given; 0, for the bench's exit status."""
    res["machine"] = machine_info()
    print(json.dumps(res, indent=1))
    if path:
        write_json(res, path)
    return 0


# ---------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------
_COLS = ("peer", "payload", "load", "n", "err", "p50", "p90", "p95", "p99", "p99.9", "max",
         "req/s", "SLO%", "stable", "server q/in/comp/out ms")


def fmt_ms(v: float | None) -> str:
    """A latency in ms for a table: 3 decimals under 1 ms, 2 under 100, none above; '-' for None."""
    if v is None:
        return "-"
    if v < 1:
        return f"{v:.3f}"
    if v < 100:
        return f"{v:.2f}"
    return f"{v:.0f}"


def _row(r: dict) -> list[str]:
    lat = r["latency_ms"]
    load = (f"c={r['concurrency']}" if r["mode"] == "closed"
            else f"{r['rate_rps']:g}/s {r['arrival']}")
    srv = r["server_ms"]
    split = ("/".join(fmt_ms(srv[k]) for k in ("queue", "input", "compute", "output"))
             if srv else "-")
    slo = r["slo_attainment"]
    return [
        r["peer"], r["payload_label"], load, str(r["requests"]), str(r["errors"]),
        *(fmt_ms(lat[k]) for k in ("p50", "p90", "p95", "p99", "p99.9", "max")),
        f"{r['throughput_rps']:.0f}" if r["throughput_rps"] is not None else "-",
        f"{100 * slo:.1f}" if slo is not None else "-",
        "yes" if r["converged"] else f"no({r['windows']})",
        split,
    ]


def _sorted_results(report: dict) -> list[dict]:
    order = {n: i for i, n in enumerate(report["peers"])}
    return sorted(report["results"], key=lambda r: (
        r["payload_bytes"], r["mode"], r["concurrency"] or 0, r["rate_rps"] or 0,
        order.get(r["peer"], 99)))


def render_table(report: dict) -> str:
    rows = [list(_COLS)] + [_row(r) for r in _sorted_results(report)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLS))]
    left = {0, 1, 2, 13, 14}

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    out = [line(rows[0]), line(["-" * w for w in widths])]
    out += [line(r) for r in rows[1:]]
    slo = report["config"].get("slo_ms")
    out.append(f"latencies in ms; SLO% = share of requests within {slo} ms (errors count as misses)")
    out += _footer_lines(report)
    return "\n".join(out)


def _footer_lines(report: dict, md: bool = False) -> list[str]:
    bullet = "- " if md else "  "
    out: list[str] = []
    if report["skipped"]:
        out.append("")
        out.append("Skipped peers:" if not md else "**Skipped peers**")
        out += [f"{bullet}{s['peer']} ({s['status']}): {s['reason']}" for s in report["skipped"]]
    if "ratios" in report:
        out.append("")
        what = ("p50 over p50; tail_*: p99 over p50" if any(k.startswith("tail_") for k in report["ratios"])
                else "p50 over p50")
        out.append(f"Ratios ({what}):" if not md else f"**Ratios** ({what})")
        for k, v in report["ratios"].items():
            if v is None:
                out.append(f"{bullet}{k}: null ({report['ratios_missing'][k]})")
            else:
                out.append(f"{bullet}{k}: {v:.3f}")
    errs = [(r["peer"], r["payload_label"], e) for r in report["results"] for e in r["error_samples"]]
    if errs:
        out.append("")
        out.append("Errors seen:" if not md else "**Errors seen**")
        out += [f"{bullet}{p} {s}: {e}" for p, s, e in errs]
    return out


def render_markdown(report: dict) -> str:
    m = report["machine"]
    out = [
        f"# bench {report['command']}",
        "",
        f"`{report['command_line']}`",
        "",
        f"{m['cpu_model']}, {m['cores']} cores, Python {m['python']}, pyzmq {m['pyzmq']} "
        f"(libzmq {m['libzmq']}), started {report['started_at']}, {report['wall_s']:.1f} s",
        "",
        "| " + " | ".join(_COLS) + " |",
        "|" + "|".join("---" if i in (0, 1, 2, 13, 14) else "---:" for i in range(len(_COLS))) + "|",
    ]
    out += ["| " + " | ".join(_row(r)) + " |" for r in _sorted_results(report)]
    out.append("")
    out.append(f"Latencies in ms. SLO% = share of requests within {report['config'].get('slo_ms')} ms "
               "(errors count as misses).")
    out += _footer_lines(report, md=True)
    return "\n".join(out) + "\n"


def write_markdown(report: dict, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        f.write(render_markdown(report))
