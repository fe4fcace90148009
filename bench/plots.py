"""PNG plots from a report dict (so they can be redrawn from a saved JSON as well).

- cdf_<workload>.png: latency CDF, one line per peer, one file per workload;
- latency_vs_size.png: p50 (solid) and p99 (dashed) against payload size, per peer, one panel
  per load level;
- throughput_vs_p99.png: p99 against throughput, one line per peer through its load levels,
  one panel per payload size.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # headless: never needs a display, and safe in worker threads
import matplotlib.pyplot as plt  # noqa: E402

from bench.hist import LatencyHistogram  # noqa: E402


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _peer_order(report: dict) -> list[str]:
    return [p for p in report["peers"] if any(r["peer"] == p for r in report["results"])]


def _colors(peers: list[str]) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {p: cycle[i % len(cycle)] for i, p in enumerate(peers)}


def _load_label(r: dict) -> str:
    return f"c={r['concurrency']}" if r["mode"] == "closed" else f"{r['rate_rps']:g}/s"


def _grid(n: int) -> tuple[int, int]:
    cols = min(n, 3)
    return (n + cols - 1) // cols, cols


def plot_cdfs(report: dict, out_dir: str) -> list[str]:
    peers = _peer_order(report)
    colors = _colors(peers)
    by_wl: dict[str, list[dict]] = defaultdict(list)
    for r in report["results"]:
        by_wl[r["workload"]].append(r)
    written = []
    for wl, rows in by_wl.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in sorted(rows, key=lambda r: peers.index(r["peer"]) if r["peer"] in peers else 99):
            if not r.get("hdr"):
                continue
            xs, ys = LatencyHistogram.decode(r["hdr"]).cdf_points()
            ax.step(xs, ys, where="post", label=r["peer"], color=colors.get(r["peer"]))
        ax.set_xscale("log")
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"latency CDF, {rows[0]['payload_label']} {_load_label(rows[0])}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        path = os.path.join(out_dir, f"cdf_{_safe(wl)}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_latency_vs_size(report: dict, out_dir: str) -> str:
    peers = _peer_order(report)
    colors = _colors(peers)
    loads = sorted({_load_label(r) for r in report["results"]})
    rows_, cols_ = _grid(max(1, len(loads)))
    fig, axes = plt.subplots(rows_, cols_, figsize=(6.5 * cols_, 4.5 * rows_), squeeze=False)
    for ax, load in zip(axes.flat, loads or [""]):
        for p in peers:
            pts = sorted((r["payload_bytes"], r["latency_ms"]["p50"], r["latency_ms"]["p99"])
                         for r in report["results"]
                         if r["peer"] == p and _load_label(r) == load
                         and r["latency_ms"]["p50"] is not None)
            if not pts:
                continue
            xs = [x for x, _, _ in pts]
            ax.plot(xs, [a for _, a, _ in pts], "o-", color=colors[p], label=f"{p} p50")
            ax.plot(xs, [b for _, _, b in pts], "s--", color=colors[p], label=f"{p} p99", alpha=0.7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("payload (bytes)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"p50 / p99 vs payload size, {load}")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(loads or [""]):]:
        ax.set_visible(False)
    path = os.path.join(out_dir, "latency_vs_size.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput_vs_p99(report: dict, out_dir: str) -> str:
    peers = _peer_order(report)
    colors = _colors(peers)
    sizes = sorted({(r["payload_bytes"], r["payload_label"]) for r in report["results"]})
    rows_, cols_ = _grid(max(1, len(sizes)))
    fig, axes = plt.subplots(rows_, cols_, figsize=(6.5 * cols_, 4.5 * rows_), squeeze=False)
    for ax, (nbytes, label) in zip(axes.flat, sizes or [(0, "")]):
        for p in peers:
            pts = sorted((r["throughput_rps"], r["latency_ms"]["p99"]) for r in report["results"]
                         if r["peer"] == p and r["payload_bytes"] == nbytes
                         and r["throughput_rps"] and r["latency_ms"]["p99"] is not None)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=colors[p], label=p)
        ax.set_xlabel("throughput (req/s)")
        ax.set_ylabel("p99 latency (ms)")
        ax.set_yscale("log")
        ax.set_title(f"throughput vs p99, {label}")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(sizes or [0]):]:
        ax.set_visible(False)
    path = os.path.join(out_dir, "throughput_vs_p99.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(report: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    written = plot_cdfs(report, out_dir)
    written.append(plot_latency_vs_size(report, out_dir))
    written.append(plot_throughput_vs_p99(report, out_dir))
    return written
