"""Outputs of `python -m bench run` from its report dict (schema "zinf-bench-run/1", see
docs/bench.md): perf_analyzer-style CSV, a terminal table, markdown and PNG plots.

Pure functions of the report, so `python -m bench render REPORT.json` redraws them from a
saved JSON and tests can feed synthetic reports.  Every optional field may be null or absent
(server_ms, batch_size, lateness_ms, streams_detail, hdr, search capacity...): unknown values
render as "-" in tables and as an empty cell in the CSV.

CSV units follow perf_analyzer: latencies and the server split in integer microseconds,
`Inferences/Second` with one decimal, `Client Send`/`Client Recv` 0 (the SDK's own time is
inside `Network+Server Send/Recv` = mean latency minus the server split's means), and
`Server Queue` = broker queue wait + worker batch wait (perf_analyzer's queue covers both;
`Server Batch Wait` gives the latter alone).
"""
from __future__ import annotations

import csv
import os
from typing import Any

from bench.report import fmt_ms

SCHEMA = "zinf-bench-run/1"

# The first CSV column names the load, by mode; CSV_COLUMNS follow it in every mode.
LOAD_COLUMNS = {"closed": "Concurrency", "open": "Request Rate", "streams": "Streams"}
CSV_PA_COLUMNS = [
    "Inferences/Second", "Client Send", "Network+Server Send/Recv", "Server Queue",
    "Server Compute Input", "Server Compute Infer", "Server Compute Output", "Client Recv",
    "p50 latency", "p90 latency", "p95 latency", "p99 latency", "Avg latency",
]
CSV_EXTRA_COLUMNS = [  # ours, after perf_analyzer's
    "Server Batch Wait", "Batch Size", "Errors", "Requests", "Lateness p99", "Valid",
    "Holds SLO", "FPS", "Drop Rate", "Stream Equivalents",
]
CSV_COLUMNS = CSV_PA_COLUMNS + CSV_EXTRA_COLUMNS

_SPLIT = ("queue", "batch_wait", "input", "compute", "output")


def is_run_report(report: dict) -> bool:
    return isinstance(report, dict) and report.get("schema") == SCHEMA


def csv_columns(mode: str) -> list[str]:
    """The full CSV header for a mode ("closed" | "open" | "streams")."""
    return [LOAD_COLUMNS.get(mode, "Load")] + CSV_COLUMNS


# ---------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------
def _mode(report: dict) -> str:
    return (report.get("config") or {}).get("mode") or (
        (report.get("results") or [{}])[0].get("mode") or "closed")


def _load(r: dict) -> Any:
    if r.get("load") is not None:
        return r["load"]
    return {"closed": r.get("concurrency"), "open": r.get("rate_rps"),
            "streams": r.get("streams")}.get(r.get("mode"))


def _num(x: Any) -> Any:
    """An integral float as an int (100.0 -> 100), anything else unchanged."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _us(ms: float | None) -> int | str:
    return "" if ms is None else int(round(ms * 1000))


def _bool(v: bool | None) -> str:
    return "" if v is None else ("true" if v else "false")


def _sorted(report: dict) -> list[dict]:
    """Results in load order (stable, so a level measured twice keeps its measured order)."""
    return sorted(report.get("results") or [], key=lambda r: (_load(r) is None, _load(r) or 0))


def _load_label(r: dict, mode: str | None = None) -> str:
    mode = mode or r.get("mode")
    v = _load(r)
    if v is None:
        return "-"
    if mode == "open":
        return f"{v:g}/s"
    if mode == "streams":
        return f"{v}x{r['fps']:g}fps" if r.get("fps") else f"{v} streams"
    return f"c={v}"


def _pct_name(report: dict) -> str:
    p = (report.get("config") or {}).get("percentile")
    if p is None:
        p = (report.get("search") or {}).get("percentile")
    return f"p{p:g}" if p is not None else "p?"


def _holds(r: dict) -> str:
    if r.get("valid") is False:
        return "INVALID"
    if r.get("holds_slo") is None:
        return "-"
    return "ok" if r["holds_slo"] else "FAIL"


# ---------------------------------------------------------------------------------------
# CSV
# ---------------------------------------------------------------------------------------
def csv_rows(report: dict) -> list[dict[str, str | int | float]]:
    mode = _mode(report)
    load_col = LOAD_COLUMNS.get(mode, "Load")
    rows = []
    for r in report.get("results") or []:
        lat = r.get("latency_ms") or {}
        srv = r.get("server_ms")
        part = {k: (srv or {}).get(k) for k in _SPLIT}
        mean = lat.get("mean")
        if mean is None:
            net: int | str = ""
        else:
            net = max(0, int(round((mean - sum(v or 0.0 for v in part.values())) * 1000)))
        queue = ("" if part["queue"] is None and part["batch_wait"] is None
                 else _us((part["queue"] or 0.0) + (part["batch_wait"] or 0.0)))
        tput = r.get("throughput_rps")
        bs = r.get("batch_size") or {}
        late = r.get("lateness_ms") or {}
        sd = r.get("streams_detail") if mode == "streams" else None
        sd = sd or {}
        drop = sd.get("drop_rate")
        se = sd.get("stream_equivalents")
        rows.append({
            load_col: "" if _load(r) is None else _num(_load(r)),
            "Inferences/Second": "" if tput is None else round(tput, 1),
            "Client Send": 0,
            "Network+Server Send/Recv": net,
            "Server Queue": queue,
            "Server Compute Input": _us(part["input"]),
            "Server Compute Infer": _us(part["compute"]),
            "Server Compute Output": _us(part["output"]),
            "Client Recv": 0,
            **{f"{k} latency": _us(lat.get(k)) for k in ("p50", "p90", "p95", "p99")},
            "Avg latency": _us(mean),
            "Server Batch Wait": _us(part["batch_wait"]),
            "Batch Size": "" if bs.get("mean") is None else round(bs["mean"], 3),
            "Errors": r.get("errors", ""),
            "Requests": r.get("requests", ""),
            "Lateness p99": _us(late.get("p99")),
            "Valid": _bool(r.get("valid")),
            "Holds SLO": _bool(r.get("holds_slo")),
            "FPS": "" if sd.get("achieved_fps") is None else sd["achieved_fps"],
            "Drop Rate": "" if drop is None else round(drop, 4),
            "Stream Equivalents": "" if se is None else round(se, 4),
        })
    return rows


def write_csv(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=csv_columns(_mode(report)))
        w.writeheader()
        w.writerows(csv_rows(report))


# ---------------------------------------------------------------------------------------
# Table and markdown
# ---------------------------------------------------------------------------------------
def _columns(report: dict) -> list[str]:
    cols = ["load", "n", "err", "p50", "p90", "p99", "max", f"{_pct_name(report)}*", "req/s",
            "SLO%", "holds", "late p99", "server q/bw/in/comp/out ms", "batch"]
    if _mode(report) == "streams":
        cols += ["fps", "drop%"]
    return cols


_LEFT = {"load", "holds", "server q/bw/in/comp/out ms"}


def _row(r: dict, mode: str) -> list[str]:
    lat = r.get("latency_ms") or {}
    srv = r.get("server_ms")
    split = "/".join(fmt_ms(srv.get(k)) for k in _SPLIT) if srv else "-"
    tput, slo = r.get("throughput_rps"), r.get("slo_attainment")
    bs = (r.get("batch_size") or {}).get("mean")
    row = [
        _load_label(r, mode), str(r.get("requests", "-")), str(r.get("errors", "-")),
        *(fmt_ms(lat.get(k)) for k in ("p50", "p90", "p99", "max")),
        fmt_ms(r.get("percentile_ms")),
        "-" if tput is None else f"{tput:.1f}",
        "-" if slo is None else f"{100 * slo:.1f}",
        _holds(r),
        fmt_ms((r.get("lateness_ms") or {}).get("p99")),
        split,
        "-" if bs is None else f"{bs:.2f}",
    ]
    if mode == "streams":
        sd = r.get("streams_detail") or {}
        fps, drop = sd.get("achieved_fps"), sd.get("drop_rate")
        row += ["-" if fps is None else f"{fps:.1f}", "-" if drop is None else f"{100 * drop:.2f}"]
    return row


def _level_unit(kind: str | None, v: Any, fps: Any = None) -> str:
    if v is None:
        return "-"
    if kind in ("rate", "open"):
        return f"{v:g} req/s"
    if kind == "streams":
        return f"{v} stream{'' if v == 1 else 's'}" + (f" at {fps:g} fps" if fps else "")
    return f"concurrency {v}"


def capacity_line(report: dict) -> str | None:
    """'capacity at p99 <= 10 ms: 350 req/s (349.2 req/s achieved); knee 300' (None without
    an SLO or a search summary)."""
    s = report.get("search")
    cfg = report.get("config") or {}
    if not s:
        return None
    slo = s.get("slo_ms", cfg.get("slo_ms"))
    kind = s.get("kind") or {"open": "rate"}.get(_mode(report), _mode(report))
    fps = cfg.get("fps")
    p = s.get("percentile", cfg.get("percentile"))
    pname = f"p{p:g}" if p is not None else _pct_name(report)
    parts = []
    if slo is None:
        parts.append("capacity: no SLO given")
    elif s.get("capacity") is None:
        parts.append(f"capacity at {pname} <= {slo:g} ms: none (no level held)")
    else:
        ach = s.get("capacity_throughput_rps")
        bound = s.get("limited_by") == "generator"
        parts.append(f"capacity at {pname} <= {slo:g} ms: {'at least ' if bound else ''}"
                     f"{_level_unit(kind, _num(s['capacity']), fps)}"
                     + ("" if ach is None else f" ({ach:.1f} req/s achieved)")
                     + (" - bound by the load generator, not the service (the next level was INVALID)"
                        if bound else ""))
    if kind == "streams" and s.get("stream_equivalents") is not None:
        parts.append(f"stream equivalents {s['stream_equivalents']:.2f}")
    if s.get("knee") is not None:
        knee = _num(s["knee"])
        parts.append(f"knee {knee:g}" if isinstance(knee, (int, float)) else f"knee {knee}")
    return "; ".join(parts)


def _shape(t: dict) -> str:
    shape = t.get("shape")
    return "x".join(str(d) for d in shape) if shape else "scalar"


def _footer_lines(report: dict, md: bool = False) -> list[str]:
    b = "- " if md else "  "
    cfg = report.get("config") or {}
    mode = _mode(report)
    out: list[str] = []
    slo = cfg.get("slo_ms")
    within = "the SLO" if slo is None else f"{slo:g} ms"
    out.append(f"latencies in ms; {_pct_name(report)}* = the percentile the SLO is judged on "
               f"(all windows merged); SLO% = share within {within} (errors count as misses)")
    tgt = report.get("target") or {}
    if tgt:
        out.append(f"target: {tgt.get('service', '?')} at {tgt.get('endpoint', '?')} "
                   f"(transport {tgt.get('transport', '?')})")
    inp = report.get("inputs") or {}
    if inp:
        src = inp.get("source", "?") + (f" {inp['path']}" if inp.get("path") else "")
        tensors = ", ".join(f"{n}={_shape(t)}:{t.get('dtype', '?')}"
                            for n, t in (inp.get("tensors") or {}).items()) or "-"
        nb = inp.get("bytes_per_request")
        out.append(f"inputs: {src}, {inp.get('samples', '?')} sample(s), {tensors}"
                   + ("" if nb is None else f", {nb:,.0f} B/request"))
    fps = cfg.get("fps")
    load = {"closed": "closed loop", "open": f"open loop ({cfg.get('arrival') or 'constant'} arrival)",
            "streams": f"streams at {'?' if fps is None else f'{fps:g}'} fps, max in flight "
                       f"{cfg.get('max_in_flight') or 1}"}.get(mode, mode)
    if cfg.get("windows") is not None:
        load += (f"; {cfg['windows']} x {cfg.get('window_s', '?')} s windows after "
                 f"{cfg.get('warmup_s', '?')} s warmup")
    out.append(f"load: {load}")
    cap = capacity_line(report)
    if cap:
        out.append(cap)
    s = report.get("search") or {}
    if s.get("searched") and s.get("steps"):
        kind = s.get("kind")
        out.append("search steps: " + ", ".join(
            f"{_level_unit(kind, _num(st.get('load')))} {'ok' if st.get('holds') else 'FAIL'}"
            for st in s["steps"]))
    results = _sorted(report)
    invalid = [r for r in results if r.get("valid") is False]
    if invalid:
        out.append("INVALID (generator could not keep the schedule):" if not md else "**INVALID**")
        out += [f"{b}{_load_label(r, mode)}: {r.get('invalid_reason') or 'no reason given'}"
                for r in invalid]
    failed = [r for r in results if r.get("valid") is not False and r.get("holds_slo") is False
              and r.get("why_not")]
    if failed:
        out.append("did not hold:" if not md else "**Did not hold**")
        out += [f"{b}{_load_label(r, mode)}: {r['why_not']}" for r in failed]
    errs = [(r, e) for r in results for e in (r.get("error_samples") or [])]
    if errs:
        out.append("errors seen:" if not md else "**Errors seen**")
        out += [f"{b}{_load_label(r, mode)}: {e}" for r, e in errs]
    metrics = [(r, r["server_metrics"]) for r in results if r.get("server_metrics")]
    if metrics:
        out.append("broker metrics (deltas per level):" if not md else "**Broker metrics**")
        for r, m in metrics:
            reqs = ", ".join(f"{k} {v}" for k, v in (m.get("requests") or {}).items()) or "-"
            means = ", ".join(f"{k.removesuffix('_mean')} {fmt_ms(m.get(k))}"
                              for k in ("queue_wait_ms_mean", "request_ms_mean", "compute_ms_mean")
                              if m.get(k) is not None)
            bsm = m.get("batch_size_mean")
            out.append(f"{b}{_load_label(r, mode)}: requests {reqs}"
                       + (f"; {means}" if means else "")
                       + ("" if bsm is None else f"; batch {bsm:.2f}"))
    gens = [(r, r["generator"]) for r in results
            if (r.get("generator") or {}).get("cpu_cores") is not None]
    if gens:
        top_r, top = max(gens, key=lambda g: g[1]["cpu_cores"])
        lo = min(g["cpu_cores"] for _, g in gens)
        procs = top.get("processes") or cfg.get("workers") or 1
        out.append(f"generator cpu: {lo:.2f}-{top['cpu_cores']:.2f} cores over {procs} process(es) "
                   f"(highest at {_load_label(top_r, mode)})")
        sat = [r for r, g in gens if g.get("saturated")]
        if sat:
            out.append("generator SATURATED (its event loop >= 90 % busy) at "
                       + ", ".join(_load_label(r, mode) for r in sat)
                       + ": it may be the bottleneck there; add --workers")
    bound = cfg.get("max_lateness_ms")
    if bound is not None and mode in ("open", "streams"):
        out.append(f"lateness bound: a level is INVALID when its generator's p99 lateness exceeds {bound:g} ms")
    if report.get("aborted"):
        out.append(f"ABORTED: {report['aborted']} (the levels above are all that was measured)")
    return out


def render_table(report: dict) -> str:
    mode = _mode(report)
    cols = _columns(report)
    rows = [cols] + [_row(r, mode) for r in _sorted(report)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if cols[i] in _LEFT else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    out = [line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows[1:]]
    return "\n".join(out + _footer_lines(report))


def render_markdown(report: dict) -> str:
    mode = _mode(report)
    cols = _columns(report)
    tgt = report.get("target") or {}
    m = report.get("machine") or {}
    out = [f"# bench run: {tgt.get('service', '?')} at {tgt.get('endpoint', '?')}", ""]
    if report.get("command_line"):
        out += [f"`{report['command_line']}`", ""]
    wall = report.get("wall_s")
    out += [f"{m.get('cpu_model', '?')}, {m.get('cores', '?')} cores, Python {m.get('python', '?')}, "
            f"pyzmq {m.get('pyzmq', '?')} (libzmq {m.get('libzmq', '?')}), started "
            f"{report.get('started_at', '?')}" + ("" if wall is None else f", {wall:.1f} s"), ""]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "|".join("---" if c in _LEFT else "---:" for c in cols) + "|")
    out += ["| " + " | ".join(_row(r, mode)) + " |" for r in _sorted(report)]
    for ln in _footer_lines(report, md=True):
        # Plain lines become paragraphs; bullets stay list items.
        out += [ln] if ln.startswith("- ") else ["", ln]
    return "\n".join(out) + "\n"


def write_markdown(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(render_markdown(report))


# ---------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------
def _save(fig, path: str, plt) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(report: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # headless, as in bench.plots
    import matplotlib.pyplot as plt

    from bench.hist import LatencyHistogram

    os.makedirs(out_dir, exist_ok=True)
    cfg = report.get("config") or {}
    slo = cfg.get("slo_ms")
    mode = _mode(report)
    results = _sorted(report)
    cap = (report.get("search") or {}).get("capacity")
    written = []

    # latency vs achieved throughput, through the levels in load order
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = [r for r in results if r.get("throughput_rps") is not None]
    for k, style in (("p50", "o-"), ("p90", "s-"), ("p99", "^-")):
        xy = [(r["throughput_rps"], (r.get("latency_ms") or {}).get(k)) for r in pts]
        xy = [(x, y) for x, y in xy if y is not None]
        if xy:
            ax.plot([x for x, _ in xy], [y for _, y in xy], style, label=k)
    bad = [r for r in pts if r.get("valid") is False and (r.get("latency_ms") or {}).get("p99")]
    if bad:
        ax.plot([r["throughput_rps"] for r in bad], [r["latency_ms"]["p99"] for r in bad], "x",
                color="red", markersize=10, label="invalid")
    if slo is not None:
        ax.axhline(slo, color="gray", linestyle="--", label=f"SLO {slo:g} ms")
    cap_r = next((r for r in pts if cap is not None and _load(r) == cap), None)
    if cap_r is not None and cap_r.get("percentile_ms") is not None:
        ax.plot([cap_r["throughput_rps"]], [cap_r["percentile_ms"]], "*", color="black",
                markersize=16, label=f"capacity {_load_label(cap_r, mode)}")
    ax.set_xlabel("achieved throughput (req/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("latency vs throughput")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    written.append(_save(fig, os.path.join(out_dir, "latency_vs_throughput.png"), plt))

    # CDF per level
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if not r.get("hdr"):
            continue
        xs, ys = LatencyHistogram.decode(r["hdr"]).cdf_points()
        if xs:
            ax.step(xs, ys, where="post", label=_load_label(r, mode))
    if slo is not None:
        ax.axvline(slo, color="gray", linestyle="--", label=f"SLO {slo:g} ms")
    if ax.get_legend_handles_labels()[0]:
        ax.set_xscale("log")
        ax.legend(fontsize="small")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("latency CDF per level")
    written.append(_save(fig, os.path.join(out_dir, "cdf.png"), plt))

    if mode == "streams":
        fig, ax = plt.subplots(figsize=(7, 4.5))
        sx, sy, mx, my, fx, fy = [], [], [], [], [], []
        for r in results:
            n, sd = _load(r), r.get("streams_detail") or {}
            if n is None:
                continue
            p99s = [s["p99_ms"] for s in sd.get("per_stream") or [] if s.get("p99_ms") is not None]
            sx += [n] * len(p99s)
            sy += p99s
            if p99s:
                mx.append(n)
                my.append(max(p99s))
            if sd.get("achieved_fps") is not None:
                fx.append(n)
                fy.append(sd["achieved_fps"])
        if sy:
            ax.scatter(sx, sy, s=14, alpha=0.6, label="p99 of each stream")
            ax.plot(mx, my, "o-", color="C3", label="max over streams")
        if slo is not None:
            ax.axhline(slo, color="gray", linestyle="--", label=f"SLO {slo:g} ms")
        ax.set_xlabel("streams")
        ax.set_ylabel("per-stream p99 latency (ms)")
        ax.grid(True, alpha=0.3)
        ax2 = ax.twinx()
        if fy:
            ax2.plot(fx, fy, "d:", color="C2", label="achieved fps (mean per stream)")
        if cfg.get("fps"):
            ax2.axhline(cfg["fps"], color="C2", alpha=0.3, label=f"target {cfg['fps']:g} fps")
        ax2.set_ylabel("fps per stream")
        tops = fy + ([cfg["fps"]] if cfg.get("fps") else [])
        ax2.set_ylim(0, 1.35 * max(tops) if tops else None)  # room above for the legend
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        if h1 or h2:
            ax.legend(h1 + h2, l1 + l2, fontsize="small", loc="upper left")
        ax.set_title("streams: per-stream p99 and achieved fps")
        written.append(_save(fig, os.path.join(out_dir, "streams_p99.png"), plt))
    return written
