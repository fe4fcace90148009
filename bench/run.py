"""`python -m bench run`: measure one service of a running deployment against an SLO.

    python -m bench run --endpoint ipc:///run/zinf/broker.sock --service cartoon \\
        --images ./frames --request-rate-range 5 --search --slo-ms 33 --percentile 99

The design, the options and the JSON schema are in docs/bench.md ("python -m bench run").
The pieces: inputs (bench.inputs), the closed and open loops (bench.loadgen, shared with
`compare` and `quick`), frame streams (bench.streams), the capacity search and the rule
for holding an SLO (bench.capacity, pure), the broker's own counts (bench.scrape), and the
outputs (bench.run_report).  This module drives them: it owns the generator processes and
the measurement of one load level.

A *generator* is one client of the target running the load's share of one process; with
`--workers N` there are N of them, each in its own process, given one start time on the
system-wide monotonic clock so their windows overlap and their histograms merge exactly.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

from bench import capacity as cap
from bench import loadgen
from bench.hist import LatencyHistogram, ServerSplit
from bench.inputs import InputError, load_samples

SCHEMA = "zinf-bench-run/1"
KINDS = {"closed": "concurrency", "open": "rate", "streams": "streams"}
STAGE_LIMIT = 512 << 20  # samples staged into shared memory once, up to this many bytes
CONNECT_TIMEOUT_S = 10.0
_DAY_S = 86400.0  # the longest window, warm-up or timeout taken


class TargetError(RuntimeError):
    """The deployment could not be reached, or the service has no worker."""


# ---------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench run",
        description="Measure a service of a running broker: closed loop, open loop or frame "
                    "streams, with a capacity search under an SLO (docs/bench.md).")
    t = p.add_argument_group("target")
    t.add_argument("--endpoint", required=True, help="the broker's client endpoint (ipc://... or tcp://...)")
    t.add_argument("--service", required=True, help="the service to measure")
    t.add_argument("--transport", choices=("auto", "shm", "inline"), default="auto",
                   help="how inputs travel (default auto: shared memory when a worker is on this host)")
    t.add_argument("--server-key", help="tcp: the broker's CurveZMQ public key (Z85 or a key file)")
    t.add_argument("--client-key", help="tcp: this client's CurveZMQ secret key file")
    t.add_argument("--insecure", action="store_true", help="tcp: no CurveZMQ (a broker run with --insecure)")
    i = p.add_argument_group("inputs (one of)")
    i.add_argument("--input", action="append", metavar="NAME=SHAPE:DTYPE",
                   help="seeded random tensor, e.g. x=16:uint8 or image=720x1280x3:uint8 (repeatable)")
    i.add_argument("--samples", type=int, default=1, help="with --input: distinct random requests (default 1)")
    i.add_argument("--npz", metavar="PATH", help="a .npz file (one request) or a folder of them")
    i.add_argument("--images", metavar="DIR", help="a folder of images, one request each (Pillow)")
    i.add_argument("--video", metavar="PATH", help="a video file, one request per frame (PyAV)")
    i.add_argument("--image-input", default="image", help="input name for --images/--video (default image)")
    i.add_argument("--resize", metavar="WxH", help="--images/--video: resize every frame")
    i.add_argument("--max-frames", type=int, default=300, help="--video: at most this many frames (default 300)")
    m = p.add_argument_group("load (one of; START:END[:STEP] or one value)")
    g = m.add_mutually_exclusive_group()
    g.add_argument("--concurrency-range", metavar="RANGE", help="closed loop (default 1)")
    g.add_argument("--request-rate-range", metavar="RANGE", help="open loop, requests/s")
    g.add_argument("--streams-range", metavar="RANGE", help="frame streams at --fps each")
    m.add_argument("--arrival", choices=("constant", "poisson"), default="constant",
                   help="open loop: evenly spaced or Poisson arrivals (default constant)")
    m.add_argument("--fps", type=float, default=30.0, help="streams: frames per second per stream (default 30)")
    m.add_argument("--max-in-flight", type=int, default=1,
                   help="streams: frames outstanding per stream before latest-wins drops (default 1)")
    m.add_argument("--workers", type=int, default=1,
                   help="generator processes (default 1); the load is split between them")
    w = p.add_argument_group("measurement")
    w.add_argument("--window-s", type=float, default=2.0, help="one measurement window (default 2)")
    w.add_argument("--warmup-s", type=float, default=0.5, help="discarded warm-up per level (default 0.5)")
    w.add_argument("--windows", type=int, default=3, help="measured windows per level (default 3)")
    w.add_argument("--timeout-s", type=float, default=30.0, help="per-request timeout (default 30; 0: none)")
    w.add_argument("--seed", type=int, default=1, help="random inputs and Poisson arrivals")
    w.add_argument("--spin-us", type=float, default=1000.0,
                   help="open loop and streams: yield instead of a ~1 ms timer for the last SPIN_US "
                        "before each send (default 1000; 0: timers only, less CPU)")
    w.add_argument("--metrics-url", help="the broker's /metrics (its --http): its own counts per level")
    s = p.add_argument_group("SLO and capacity")
    s.add_argument("--slo-ms", type=float, default=10.0, help="latency SLO (default 10 ms)")
    s.add_argument("--percentile", type=float, default=99.0, help="the percentile held to it (default 99)")
    s.add_argument("--search", action="store_true",
                   help="find the highest load that holds the SLO (from START, capped at END)")
    s.add_argument("--resolution", type=float, default=0.05, help="rate search: stop within this (default 0.05)")
    s.add_argument("--max-error-rate", type=float, default=0.001, help="a level holding the SLO has at most this (0.001)")
    s.add_argument("--max-drop-rate", type=float, default=0.01, help="streams: at most this share dropped (0.01)")
    s.add_argument("--max-lateness-ms", type=float,
                   help="p99 generator lateness beyond which a result is invalid (default SLO/10)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the JSON report")
    o.add_argument("--csv", metavar="PATH", help="write the CSV (perf_analyzer's columns)")
    o.add_argument("--markdown", metavar="PATH", help="write a markdown table")
    o.add_argument("--plots", metavar="DIR", help="write PNG plots")
    o.add_argument("--quiet", action="store_true", help="no progress, no table")
    o.add_argument("--no-uvloop", action="store_true", help="the default asyncio loop instead of uvloop")
    return p


@dataclass
class Plan:
    """What to run, checked: mode, levels (or the search's bounds) and the SLO rule."""

    mode: str
    levels: list
    search: bool
    start: Any = None
    cap_: Any = None
    cfg: dict = field(default_factory=dict)


def make_plan(a: argparse.Namespace) -> Plan:
    """Usage errors raise ValueError (cap.RangeError is one) with the message to print."""
    if a.request_rate_range:
        mode, text, integer = "open", a.request_rate_range, False
    elif a.streams_range:
        mode, text, integer = "streams", a.streams_range, True
    else:
        mode, text, integer = "closed", a.concurrency_range or "1", True
    # Finite, and in range: NaN passed every comparison (--warmup-s nan failed the generator
    # with "cannot convert float NaN to integer", --timeout-s nan meant no timeout, --max-lateness-ms
    # nan turned the lateness check off), an infinite --window-s failed it with an
    # OverflowError, a negative --max-lateness-ms marked every level INVALID (the
    # configuration hunt).
    for name, v, lo, hi in (("--window-s", a.window_s, 0, _DAY_S), ("--warmup-s", a.warmup_s, 0, _DAY_S),
                            ("--timeout-s", a.timeout_s, 0, _DAY_S), ("--fps", a.fps, 0, 1e6),
                            ("--slo-ms", a.slo_ms, 0, _DAY_S * 1e3), ("--spin-us", a.spin_us, 0, 1e6),
                            ("--max-lateness-ms", a.max_lateness_ms, 0, _DAY_S * 1e3)):
        if v is not None and not (math.isfinite(v) and lo <= v <= hi):
            raise ValueError(f"{name} must be a number from {lo:g} to {hi:g}, got {v}")
    for name, v in (("--window-s", a.window_s), ("--fps", a.fps), ("--slo-ms", a.slo_ms)):
        if not v > 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if a.windows < 1 or a.workers < 1 or a.max_in_flight < 1 or a.samples < 1:
        raise ValueError("--windows, --workers, --max-in-flight and --samples must be at least 1")
    if not 0 < a.percentile < 100:
        raise ValueError(f"--percentile must be between 0 and 100, got {a.percentile}")
    for name, v in (("--max-error-rate", a.max_error_rate), ("--max-drop-rate", a.max_drop_rate)):
        if not 0 <= v <= 1:
            raise ValueError(f"{name} is a fraction between 0 and 1, got {v}")
    if a.warmup_s < 0 or a.timeout_s < 0:
        raise ValueError("--warmup-s and --timeout-s cannot be negative")
    lateness = a.max_lateness_ms if a.max_lateness_ms is not None else a.slo_ms / 10
    cfg = {"slo_ms": a.slo_ms, "percentile": a.percentile, "max_error_rate": a.max_error_rate,
           "max_drop_rate": a.max_drop_rate, "max_lateness_ms": lateness}
    if a.search:
        start, end = cap.parse_range_bounds(text, integer)
        end = end if end is not None else cap.DEFAULT_CAP[KINDS[mode]]
        cap.Search(KINDS[mode], start, end, a.resolution)  # its own checks (start <= cap, resolution > 0)
        return Plan(mode, [start, end], True, start, end, cfg)
    return Plan(mode, cap.expand_range(text, integer), False, cfg=cfg)


# ---------------------------------------------------------------------------------------
# One generator: a client of the target and its share of the load
# ---------------------------------------------------------------------------------------
@dataclass
class GenOptions:
    """Everything a generator process needs (picklable): it loads the inputs itself, from
    the same options, so every process sends the same bytes."""

    endpoint: str
    service: str
    transport: str
    timeout_s: float | None
    server_key: str | None
    client_key: str | None
    insecure: bool
    input_opts: dict
    spin_us: float


class Generator:
    def __init__(self, opts: GenOptions, samples: list[dict] | None = None):
        self.opts = opts
        self.samples = samples
        self.client: Any = None
        self.staged: list[dict] = []
        self.staged_shm = False
        self._i = 0

    async def start(self) -> dict:
        from client_sdk import AsyncClient

        o = self.opts
        if self.samples is None:
            self.samples, _ = load_samples(**o.input_opts)
        try:
            self.client = AsyncClient(o.endpoint, transport=o.transport, timeout=o.timeout_s,
                                      server_key=o.server_key, client_key=o.client_key,
                                      insecure=o.insecure,
                                      pool_capacity=self._pool_bytes())
        except Exception as e:  # a malformed endpoint, tcp without keys, a bad key file, ...
            # (the SDK names its own arguments; this command's are flags: the bench audit)
            why = (str(e).replace("server_key=", "--server-key").replace("client_key=", "--client-key")
                   .replace("insecure=True", "--insecure"))
            raise TargetError(f"cannot make a client for {o.endpoint}: {why}") from None
        try:
            has = await self.client.mmi_service(o.service, timeout=CONNECT_TIMEOUT_S)
        except Exception as e:
            raise TargetError(f"no answer from a broker at {o.endpoint} within "
                              f"{CONNECT_TIMEOUT_S:g} s ({type(e).__name__}: {e})") from None
        if not has:
            raise TargetError(f"the broker at {o.endpoint} has no worker for service {o.service!r}")
        self.staged = self._stage()
        return {"staged_shm": self.staged_shm}

    def _bytes(self) -> int:
        return sum(int(a.nbytes) for s in self.samples for a in s.values())

    def _pool_bytes(self) -> int:
        """The SDK's default pool, plus room for the staged samples when they will be."""
        n = self._bytes()
        return (256 << 20) + (2 * n if n <= STAGE_LIMIT else 0)

    def _stage(self) -> list[dict]:
        """Write each sample into the client's shared memory once (an application's tensor
        lives there: a camera ring, a preprocessing output), when the inputs go that way and
        fit; otherwise the SDK packs the arrays per request."""
        if not self.client.uses_shm or self._bytes() > STAGE_LIMIT:
            return self.samples
        out = []
        try:
            for s in self.samples:
                staged = {}
                for k, a in s.items():
                    buf = self.client.alloc(a.shape, a.dtype)
                    np.copyto(buf, a)
                    staged[k] = buf
                out.append(staged)
        except Exception:
            return self.samples
        self.staged_shm = True
        return out

    async def _request(self, _payload: Any) -> dict | None:
        inputs = self.staged[self._i % len(self.staged)]
        self._i += 1
        res = await self.client.infer(self.opts.service, inputs)
        try:
            return dict(res.timing) if res.timing else None
        finally:
            res.release()

    async def window(self, spec: dict) -> dict:
        """Run this generator's share of one streams window, or of a whole closed- or
        open-loop level (warm-up and windows back to back); the result in wire form, a level
        as {"windows": [one per window]}."""
        cpu0, loop0 = time.process_time(), time.thread_time()
        mode, t0 = spec["mode"], spec["t0_ns"]
        timeout = self.opts.timeout_s
        if mode == "streams":
            from bench import streams as st

            if spec["streams"] <= 0:
                return _idle_window(cpu0)
            w = await st.streams_window(
                self.client, self.opts.service, self.staged, streams=spec["streams"], fps=spec["fps"],
                duration_s=spec["duration_s"], t0_ns=t0, first_stream=spec["first_stream"],
                total_streams=spec["total_streams"], max_in_flight=spec["max_in_flight"],
                timeout_s=timeout, spin_us=self.opts.spin_us)
            return {"hist": w.hist.encode(), "lateness": w.lateness.encode(),
                    "ok": sum(s["completed"] for s in w.per_stream), "errors": w.errors,
                    "timeouts": w.timeouts, "error_samples": list(w.error_samples),
                    "elapsed_s": w.elapsed_s, "split": w.split, "streams": w,
                    "cpu_s": time.process_time() - cpu0, "loop_cpu_s": time.thread_time() - loop0}
        k, warm, win = spec["windows"], spec["warmup_s"], spec["window_s"]
        if mode == "closed":
            if spec["concurrency"] <= 0:
                return {"windows": [_idle_window(cpu0) for _ in range(k)]}
            rs = await loadgen.closed_loop_windows(self._request, None, concurrency=spec["concurrency"],
                                                   warmup_s=warm, window_s=win, windows=k,
                                                   timeout_s=timeout, start_ns=t0)
        else:
            rs = await loadgen.open_loop_windows(self._request, None, rate=spec["rate"], warmup_s=warm,
                                                 window_s=win, windows=k, arrival=spec["arrival"],
                                                 seed=spec["seed"], timeout_s=timeout,
                                                 spin_us=self.opts.spin_us, t0_ns=t0, part=tuple(spec["part"]))
        # The CPU of the measured windows: the level's, less the warm-up's share; all threads
        # (libzmq's I/O thread too), and the event loop's thread alone.
        share = (k * win) / (warm + k * win)
        cpu, loop_cpu = (time.process_time() - cpu0) * share, (time.thread_time() - loop0) * share
        return {"windows": [{"hist": r.hist.encode(),
                             "lateness": r.lateness.encode() if r.lateness is not None else None,
                             "ok": r.ok, "errors": r.errors, "timeouts": r.timeouts,
                             "error_samples": list(r.error_samples), "elapsed_s": r.elapsed_s,
                             "split": r.split, "streams": None, "cpu_s": cpu / k, "served": r.served,
                             "loop_cpu_s": loop_cpu / k} for r in rs]}

    async def close(self) -> None:
        if self.client is not None:
            client, self.client, self.staged = self.client, None, []
            await client.close()


def _idle_window(cpu0: float) -> dict:
    return {"hist": None, "lateness": None, "ok": 0, "errors": 0, "timeouts": 0, "error_samples": [],
            "elapsed_s": 0.0, "split": ServerSplit(), "streams": None,
            "cpu_s": time.process_time() - cpu0, "loop_cpu_s": 0.0}




class LocalGenerators:
    """One generator on this process's own loop (--workers 1)."""

    processes = 1

    def __init__(self, opts: GenOptions, samples: list[dict], use_uvloop: bool):
        self.runner, self.loop_name = loadgen.runner(use_uvloop)
        self.gen = Generator(opts, samples)

    def start(self) -> dict:
        return self.runner.run(self.gen.start())

    def windows(self, specs: list[dict]) -> list[dict]:
        try:
            return [self.runner.run(self.gen.window(specs[0]))]
        except (KeyboardInterrupt, TargetError):
            raise
        except asyncio.CancelledError:
            # Only Ctrl-C cancels this task; a SIGINT landing while asyncio.Runner.run sets
            # itself up is reported as a bare cancellation (it resets its interrupt count
            # after installing its handler).
            raise KeyboardInterrupt from None
        except Exception as e:  # as a generator process reports it: the run stops, its report stays
            raise TargetError(f"the generator failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        try:
            self.runner.run(self.gen.close())
        finally:
            self.runner.close()


def _child(conn, opts: GenOptions, use_uvloop: bool) -> None:
    """A generator process: start, then run windows as the parent asks, until None."""
    import signal

    from bench.echo_servers import die_with_parent

    die_with_parent()
    # Ctrl-C reaches the whole process group: the parent ends the run (sends None, joins).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner, _ = loadgen.runner(use_uvloop)
    gen = Generator(opts)
    try:
        try:
            conn.send(("ok", runner.run(gen.start())))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
            return
        while True:
            spec = conn.recv()
            if spec is None:
                return
            try:
                conn.send(("ok", runner.run(gen.window(spec))))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        try:
            runner.run(gen.close())
        finally:
            runner.close()
            conn.close()


class ProcessGenerators:
    """N generator processes (--workers N), each with its own client and event loop."""

    def __init__(self, opts: GenOptions, n: int, use_uvloop: bool, reply_timeout_s: float):
        ctx = mp.get_context("spawn")
        self.processes = n
        self.loop_name = "uvloop" if use_uvloop else "asyncio"
        self.reply_timeout_s = reply_timeout_s
        self.conns, self.procs = [], []
        for j in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_child, args=(child, opts, use_uvloop), name=f"bench-gen-{j}", daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def _collect(self, timeout_s: float) -> list[Any]:
        out = []
        deadline = time.monotonic() + timeout_s
        for j, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                raise TargetError(f"generator process {j} did not answer within {timeout_s:g} s")
            try:
                kind, val = c.recv()
            except EOFError:
                raise TargetError(f"generator process {j} exited (code {self.procs[j].exitcode})") from None
            if kind != "ok":
                raise TargetError(f"generator process {j}: {val}")
            out.append(val)
        return out

    def start(self) -> dict:
        infos = self._collect(CONNECT_TIMEOUT_S + 120.0)  # spawning and loading inputs included
        return {"staged_shm": all(i["staged_shm"] for i in infos)}

    def windows(self, specs: list[dict]) -> list[dict]:
        for c, spec in zip(self.conns, specs):
            c.send(spec)
        longest = max(s["duration_s"] if s["mode"] == "streams"
                      else s["warmup_s"] + s["windows"] * s["window_s"] for s in specs)
        return self._collect(self.reply_timeout_s + longest)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        try:
            for p in self.procs:
                p.join(timeout=10.0)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5.0)
        except KeyboardInterrupt:
            # A second Ctrl-C while the generators wind down: they are killed, not waited
            # for, and the run goes on to write what it measured (the traceback lost the
            # whole report: the bench audit).
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            for p in self.procs:
                p.join(timeout=5.0)
        for c in self.conns:
            c.close()


# ---------------------------------------------------------------------------------------
# One load level
# ---------------------------------------------------------------------------------------
def _shares(total: int, n: int) -> list[int]:
    return [total // n + (1 if j < total % n else 0) for j in range(n)]


def window_specs(mode: str, load: Any, n: int, t0_ns: int, a: argparse.Namespace,
                 duration_s: float | None = None) -> list[dict]:
    """The load split between n generators: a whole level (closed and open loop: warm-up
    and windows back to back), or one window of streams."""
    if mode == "streams":
        base = {"mode": mode, "duration_s": duration_s, "t0_ns": t0_ns}
        shares, first, specs = _shares(int(load), n), 0, []
        for s in shares:
            specs.append(dict(base, streams=s, first_stream=first, total_streams=int(load), fps=a.fps,
                              max_in_flight=a.max_in_flight))
            first += s
        return specs
    base = {"mode": mode, "t0_ns": t0_ns, "warmup_s": a.warmup_s, "window_s": a.window_s,
            "windows": a.windows}
    if mode == "closed":
        return [dict(base, concurrency=c) for c in _shares(int(load), n)]
    # One seed for every level and rerun: comparable arrivals.  All n generators get the
    # same schedule and each takes every n-th request of it.
    return [dict(base, rate=float(load), arrival=a.arrival, seed=a.seed * 1_000_003, part=(j, n))
            for j in range(n)]


@dataclass
class Level:
    """The windows of one level, merged."""

    hist: LatencyHistogram = field(default_factory=LatencyHistogram)
    lateness: LatencyHistogram | None = None
    split: ServerSplit = field(default_factory=ServerSplit)
    ok: int = 0
    errors: int = 0
    timeouts: int = 0
    error_samples: list[str] = field(default_factory=list)
    measured_s: float = 0.0
    served: int = 0  # successful replies that arrived during the windows (the tail's in the last)
    cpu_s: float = 0.0
    loop_cpu_s: float = 0.0
    loop_max: float = 0.0  # the busiest generator loop's CPU share in any window
    window_pct: list = field(default_factory=list)
    window_rps: list = field(default_factory=list)
    window_split: list = field(default_factory=list)
    streams: list = field(default_factory=list)

    def add_window(self, outs: list[dict], percentile: float) -> None:
        w = LatencyHistogram()
        split = ServerSplit()
        ok, elapsed, served = 0, 0.0, 0
        for o in outs:
            if o["hist"]:
                w.add(LatencyHistogram.decode(o["hist"]))
            if o["lateness"]:
                if self.lateness is None:
                    self.lateness = LatencyHistogram()
                self.lateness.add(LatencyHistogram.decode(o["lateness"]))
            split.merge(o["split"])
            ok += o["ok"]
            served += o.get("served", o["ok"])
            self.errors += o["errors"]
            self.timeouts += o["timeouts"]
            for e in o["error_samples"]:
                if len(self.error_samples) < loadgen.ERROR_SAMPLES and e not in self.error_samples:
                    self.error_samples.append(e)
            elapsed = max(elapsed, o["elapsed_s"])
            self.cpu_s += o["cpu_s"]
            self.loop_cpu_s += o["loop_cpu_s"]
            if o["elapsed_s"] > 0:
                self.loop_max = max(self.loop_max, o["loop_cpu_s"] / o["elapsed_s"])
            if o["streams"] is not None:
                self.streams.append(o["streams"])
        self.hist.add(w)
        self.split.merge(split)
        self.ok += ok
        self.served += served
        self.measured_s += elapsed
        self.window_pct.append(round(w.percentile_ms(percentile), 3) if w.count else None)
        # Served: replies that arrived during the window (streams: its frames' results).
        self.window_rps.append(round(served / elapsed, 2) if elapsed > 0 else None)
        self.window_split.append(split.means_ms())


def _r(x: Any, nd: int = 3) -> Any:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return round(x, nd)


def level_entry(mode: str, load: Any, lv: Level, a: argparse.Namespace, plan: Plan, processes: int,
                server_metrics: dict | None) -> dict:
    cfg = plan.cfg
    h = lv.hist
    n_all = lv.ok + lv.errors
    lat = h.summary_ms() if h.count else None
    entry: dict[str, Any] = {
        "mode": mode, "load": load,
        "concurrency": load if mode == "closed" else None,
        "rate_rps": load if mode == "open" else None,
        "streams": load if mode == "streams" else None,
        "fps": a.fps if mode == "streams" else None,
        "requests": lv.ok, "errors": lv.errors, "timeouts": lv.timeouts,
        "error_samples": lv.error_samples,
        "measured_s": round(lv.measured_s, 3),
        # What was served over the windows' time: replies that arrived then (the successes of
        # the requests sent then read low under overload, the warm-up's backlog served in
        # the windows' time: the bench hunt).
        "throughput_rps": round(lv.served / lv.measured_s, 2) if lv.measured_s > 0 else 0.0,
        "latency_ms": lat,
        "percentile_ms": _r(h.percentile_ms(a.percentile)) if h.count else None,
        "window_percentile_ms": lv.window_pct,
        "window_throughput_rps": lv.window_rps,
        "window_server_ms": lv.window_split,
        "slo_attainment": round(h.count_at_or_below_ms(a.slo_ms) / n_all, 4) if n_all else None,
        "valid": True, "invalid_reason": None,
        "lateness_ms": None,
        "server_ms": lv.split.means_ms(),
        "server_samples": lv.split.samples,
        "batch_size": lv.split.batch_size(),
        "server_metrics": server_metrics,
        "streams_detail": None,
        "generator": {"processes": processes, "cpu_s": round(lv.cpu_s, 3),
                      "cpu_cores": round(lv.cpu_s / lv.measured_s, 3) if lv.measured_s > 0 else None,
                      "loop_cpu_cores_max": round(lv.loop_max, 3), "saturated": False},
        "hdr": h.encode() if h.count else None,
    }
    if lv.lateness is not None and lv.lateness.count:
        lt = lv.lateness
        p99 = lt.percentile_ms(99)
        entry["lateness_ms"] = {"p50": _r(lt.percentile_ms(50), 4), "p99": _r(p99, 4), "max": _r(lt.max_ms(), 4)}
        if p99 > cfg["max_lateness_ms"]:
            entry["valid"] = False
            entry["invalid_reason"] = (
                f"the load generator ran late: p99 lateness {p99:.3g} ms > {cfg['max_lateness_ms']:g} ms "
                f"(it could not keep the schedule; add --workers, or run it on a quieter machine)")
    # A closed-loop generator whose event loop is busy 90 % of the time is a bottleneck itself
    # (a closed loop has no schedule to be late for, so this is its only sign): flagged, not
    # invalidated.  Open loop and streams spin-wait before each send (--spin-us), so their
    # loops look busy whatever they do: lateness is their sign.
    entry["generator"]["saturated"] = mode == "closed" and lv.loop_max >= 0.9
    if mode == "streams" and lv.streams:
        from bench import streams as st

        merged = st.merge(lv.streams)
        entry["streams_detail"] = st.detail(merged, a.fps, a.slo_ms)
    holds, why = cap.evaluate(entry, cfg)
    entry["holds_slo"], entry["why_not"] = holds, why
    return entry


class _ScrapeAt:
    """Scrape the broker at a moment of the schedule (the first measured window's start),
    from a thread, so the generator's loop is never blocked on HTTP."""

    def __init__(self, scraper: Any, at_ns: int):
        import threading

        self.scraper, self.at_ns, self.error, self.text = scraper, at_ns, None, None
        self.thread = threading.Thread(target=self._run, name="bench-scrape", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        left = self.at_ns - time.perf_counter_ns()
        if left > 0:
            time.sleep(left / 1e9)  # a scheduled action, not a synchronisation
        try:
            self.text = self.scraper.fetch_text()  # parsed later, off the generator's hot time
        except Exception as e:
            self.error = str(e)

    def figures(self) -> dict:
        self.thread.join(timeout=30.0)
        if self.thread.is_alive() or self.error is not None:
            return {"error": self.error or "the scrape did not finish within 30 s"}
        try:
            return self.scraper.figures_since(self.text)
        except Exception as e:
            return {"error": str(e)}


def measure_level(gens: Any, mode: str, load: Any, a: argparse.Namespace, plan: Plan,
                  scraper: Any, progress: Any) -> dict:
    margin_ns = 20_000_000 if gens.processes == 1 else 100_000_000  # all generators ready by then
    lv = Level()
    t0 = time.perf_counter_ns() + margin_ns
    if mode != "streams":
        progress.window(mode, load, 0)
        at = _ScrapeAt(scraper, t0 + int(a.warmup_s * 1e9)) if scraper is not None else None
        outs = gens.windows(window_specs(mode, load, gens.processes, t0, a))
        for k in range(a.windows):
            lv.add_window([o["windows"][k] for o in outs], a.percentile)
        return level_entry(mode, load, lv, a, plan, gens.processes, at.figures() if at else None)
    # Streams: each window its own round.  A latest-wins stream holds at most max-in-flight
    # frames, so the system refills within a frame period: windows need no continuity.
    if a.warmup_s > 0:
        progress.window(mode, load, -1)
        gens.windows(window_specs(mode, load, gens.processes, t0, a, duration_s=a.warmup_s))
    at = _ScrapeAt(scraper, 0) if scraper is not None else None
    for k in range(a.windows):
        progress.window(mode, load, k)
        t0 = time.perf_counter_ns() + margin_ns
        lv.add_window(gens.windows(window_specs(mode, load, gens.processes, t0, a, a.window_s)),
                      a.percentile)
    return level_entry(mode, load, lv, a, plan, gens.processes, at.figures() if at else None)


class Progress:
    """A tqdm bar over levels on stderr for a human watching; step lines otherwise."""

    def __init__(self, total: int | None, enabled: bool, unit: str):
        self.bar = None
        self.unit = unit
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="level", file=sys.stderr, leave=False, dynamic_ncols=True)

    def window(self, mode: str, load: Any, k: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{load:g} {self.unit} | {'warm-up' if k < 0 else f'window {k + 1}'}",
                                     refresh=True)

    def level_done(self, e: dict, percentile: float) -> None:
        if not self.enabled:
            return
        p = e["percentile_ms"]
        verdict = "holds" if e["holds_slo"] else f"FAILS ({e['why_not']})"
        line = (f"  {e['load']:g} {self.unit}: p{percentile:g} {'-' if p is None else f'{p:.3f} ms'}, "
                f"{e['throughput_rps']:.1f} req/s, {verdict}")
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
            self.bar.update(1)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


UNITS = {"closed": "in flight", "open": "req/s", "streams": "streams"}


def run_levels(gens: Any, plan: Plan, a: argparse.Namespace, scraper: Any,
               results: list[dict], search: Any = None) -> None:
    """Measure the levels (or drive `search`), appending each level's entry to `results`
    as it ends, so that a run cut short still reports what it measured."""
    progress = Progress(None if plan.search else len(plan.levels), not a.quiet, UNITS[plan.mode])
    try:
        if not plan.search:
            for load in plan.levels:
                e = measure_level(gens, plan.mode, load, a, plan, scraper, progress)
                results.append(e)
                progress.level_done(e, a.percentile)
            return
        while (load := search.next_load()) is not None:
            e = measure_level(gens, plan.mode, load, a, plan, scraper, progress)
            results.append(e)
            progress.level_done(e, a.percentile)
            search.record(load, e["holds_slo"], e["percentile_ms"], e["throughput_rps"], e["why_not"])
    finally:
        progress.close()


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------
def config_dict(a: argparse.Namespace, plan: Plan) -> dict:
    return {
        "mode": plan.mode, "levels": plan.levels, "arrival": a.arrival if plan.mode == "open" else None,
        "fps": a.fps if plan.mode == "streams" else None,
        "max_in_flight": a.max_in_flight if plan.mode == "streams" else None,
        "window_s": a.window_s, "warmup_s": a.warmup_s, "windows": a.windows,
        "timeout_s": a.timeout_s if a.timeout_s > 0 else None, "seed": a.seed,
        "slo_ms": a.slo_ms, "percentile": a.percentile, "search": plan.search, "resolution": a.resolution,
        "max_error_rate": a.max_error_rate, "max_drop_rate": a.max_drop_rate,
        "max_lateness_ms": plan.cfg["max_lateness_ms"], "workers": a.workers, "spin_us": a.spin_us,
        "metrics_url": a.metrics_url,
    }


def main(argv: list[str], argv_full: list[str] | None = None) -> int:
    import shlex

    from bench import run_report as rr
    from bench.report import machine_info

    argv_full = argv_full or [sys.executable, "-m", "bench", "run", *argv]
    a = build_parser().parse_args(argv)
    from bench.report import output_problem

    why = output_problem({"--json": a.json, "--csv": a.csv, "--markdown": a.markdown}, {"--plots": a.plots})
    if why is not None:  # before the run: not after minutes of measuring
        print(f"python -m bench run: error: {why}", file=sys.stderr)
        return 2
    try:
        plan = make_plan(a)
        input_opts = dict(inputs=a.input, npz=a.npz, images=a.images, video=a.video,
                          image_input=a.image_input, resize=a.resize, max_frames=a.max_frames,
                          samples=a.samples, seed=a.seed)
        samples, inputs_info = load_samples(**input_opts)
    except (ValueError, InputError) as e:  # RangeError and InputError are ValueErrors
        print(f"python -m bench run: error: {e}", file=sys.stderr)
        return 2
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t_start = time.monotonic()
    opts = GenOptions(a.endpoint, a.service, a.transport, a.timeout_s if a.timeout_s > 0 else None,
                      a.server_key, a.client_key, a.insecure, input_opts, a.spin_us)
    scraper = None
    if a.metrics_url:
        from bench.scrape import Scraper

        scraper = Scraper(a.metrics_url, a.service)
    if a.workers == 1:
        gens: Any = LocalGenerators(opts, samples, not a.no_uvloop)
    else:
        samples = []  # each process loads its own; free ours
        try:
            gens = ProcessGenerators(opts, a.workers, not a.no_uvloop,
                                     reply_timeout_s=(a.timeout_s or 60.0) + 30.0)
        except KeyboardInterrupt:
            return 130
    results: list[dict] = []
    search = cap.Search(KINDS[plan.mode], plan.start, plan.cap_, a.resolution) if plan.search else None
    aborted, rc = None, 0
    try:
        try:
            info = gens.start()
        except TargetError as e:
            print(f"python -m bench run: {e}", file=sys.stderr)
            return 1
        inputs_info["staged_shm"] = info["staged_shm"]
        run_levels(gens, plan, a, scraper, results, search)
    except TargetError as e:
        aborted, rc = str(e), 1
    except KeyboardInterrupt:
        aborted, rc = "interrupted (Ctrl-C)", 130
    finally:
        gens.close()
    if aborted:
        print(f"python -m bench run: stopped after {len(results)} level(s): {aborted}", file=sys.stderr)
    kind = KINDS[plan.mode]
    report = {
        "schema": SCHEMA,
        "command": "run",
        "argv": argv_full,
        "command_line": shlex.join(argv_full),
        "started_at": started_at,
        "wall_s": round(time.monotonic() - t_start, 2),
        "machine": machine_info(gens.loop_name),
        "target": {"endpoint": a.endpoint, "service": a.service, "transport": a.transport},
        "inputs": inputs_info,
        "config": config_dict(a, plan),
        "results": results,
        "search": cap.summary(results, plan.cfg, kind, plan.search,
                              search.steps if search is not None else None),
        "aborted": aborted,
    }
    if not a.quiet:
        print(rr.render_table(report))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if a.csv:
        rr.write_csv(report, a.csv)
    if a.markdown:
        rr.write_markdown(report, a.markdown)
    if a.plots and results:
        rr.write_plots(report, a.plots)
    return rc
